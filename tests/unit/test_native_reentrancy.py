"""The native path's loop back into the Trainer (engine/native/__init__.py): a hosted model's
compute runs as sequenced Trainer calls, waited for on a worker thread; the same call made on
the Trainer's own event-loop thread would wait for itself, so it is refused at once."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from engine.native.sequenced_backend import ReentrantCallError, SequencedTrainerBackend
from engine.protocol import LoraSpec
from engine.trainer import Trainer

MOCK = {"name": "twinkle/tiny-chat", "backend": "mock", "execution": "sequential"}


def test_a_call_from_a_worker_runs_and_one_from_the_loop_thread_is_refused(tmp_path: Path):
    trainer = Trainer(MOCK, str(tmp_path))

    async def main() -> None:
        backend = SequencedTrainerBackend(
            trainer, asyncio.get_running_loop(), model_id="s:tw-0123abcd", tenant="7"
        )
        # a worker thread (as NativeModelHost drives the model): the Trainer's loop runs it
        await asyncio.to_thread(backend.create_adapter, "default", LoraSpec(rank=4))
        assert backend.has_adapter("default")
        adapters = [a["model_id"] for a in (await trainer.stats())["adapters"]]
        assert adapters == ["s:tw-0123abcd:default"]
        # the loop's own thread: waiting here would block the loop that must run the call
        with pytest.raises(ReentrantCallError, match="event loop thread"):
            backend.create_adapter("other", LoraSpec(rank=4))
        assert not backend.has_adapter("other")
        await asyncio.to_thread(backend.delete_adapter, "default")

    asyncio.run(main())
