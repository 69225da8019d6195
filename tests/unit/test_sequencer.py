"""seq_id ordering per model: out-of-order arrivals run in order; failures advance the sequence;
gaps are skipped after the timeout."""

from __future__ import annotations

import asyncio

import pytest

from engine.errors import UserInputError
from engine.scheduling.sequencer import Sequencer


def test_out_of_order_requests_run_in_seq_order():
    async def main():
        seq = Sequencer()
        seq.start("m", 1)
        order: list[int] = []

        async def req(i: int, delay: float):
            await asyncio.sleep(delay)
            async with seq.turn("m", i):
                await asyncio.sleep(0.01)
                order.append(i)

        await asyncio.gather(req(3, 0.0), req(2, 0.01), req(4, 0.0), req(1, 0.05))
        return order

    assert asyncio.run(main()) == [1, 2, 3, 4]


def test_failure_advances_and_replay_is_refused():
    async def main():
        seq = Sequencer()
        seq.start("m", 1)
        with pytest.raises(RuntimeError):
            async with seq.turn("m", 1):
                raise RuntimeError("boom")
        async with seq.turn("m", 2):
            pass
        with pytest.raises(UserInputError, match="already executed"):
            async with seq.turn("m", 1):
                pass

    asyncio.run(main())


def test_models_are_independent_and_gap_is_skipped():
    async def main():
        seq = Sequencer(gap_timeout=0.3)
        seq.start("a", 1)
        seq.start("b", 1)
        ran: list[str] = []
        async with seq.turn("b", 1):
            ran.append("b1")
        # a:1 never arrives; a:2 runs after the gap timeout instead of hanging forever
        async with seq.turn("a", 2):
            ran.append("a2")
        return ran

    assert asyncio.run(asyncio.wait_for(main(), 5)) == ["b1", "a2"]
