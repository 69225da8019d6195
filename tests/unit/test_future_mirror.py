"""Another gateway replica answers a future's retrieve_future from the shared KV
(gateway/futures/store.py): the pending record is there before the client hears the future's id,
and a finished future reaches the KV even when Redis refuses the first writes (restarting), instead
of that replica answering try_again until the pending record expires a day later."""

from __future__ import annotations

import asyncio

from gateway.futures import store as store_mod
from gateway.futures.kv import MemoryKV
from gateway.futures.store import FutureStore


class _RestartingKV(MemoryKV):
    """A shared KV whose writes fail while ``down`` is above zero (one failure per write)."""

    def __init__(self) -> None:
        super().__init__()
        self.down = 0
        self.refused = 0

    async def set(self, key: str, value: bytes, ttl_s: float, *, only_new: bool = False) -> bool:
        if self.down > 0:
            self.down -= 1
            self.refused += 1
            raise ConnectionError("Redis is restarting")
        return await super().set(key, value, ttl_s, only_new=only_new)


def test_a_finished_future_is_mirrored_after_the_kv_comes_back(monkeypatch) -> None:
    monkeypatch.setattr(store_mod, "MIRROR_RETRY_S", (0.01, 0.01, 0.01, 0.01))

    async def main() -> None:
        kv = _RestartingKV()
        owner, other = FutureStore(kv, shared=True), FutureStore(kv, shared=True)
        await owner.start()
        await other.start()
        gate = asyncio.Event()

        async def run():
            await gate.wait()
            return "json", {"loss": 1.5}

        rec = await owner.submit(user_id=7, kind="forward_backward", run=run)
        await asyncio.sleep(0.01)  # the pending record is mirrored
        seen = await other.find(rec.request_id, 7)
        assert not isinstance(seen, str) and not seen.done.is_set()
        kv.down = 3  # Redis restarts just as the step finishes
        gate.set()
        done = await other.wait(seen, timeout=2.0)
        assert done is not None and done.json_result == {"loss": 1.5}
        assert kv.refused == 3
        await owner.aclose()
        await other.aclose()

    asyncio.run(main())


class _SlowKV(MemoryKV):
    """A shared KV whose writes take ``delay_s`` (a loaded Redis host)."""

    def __init__(self, delay_s: float) -> None:
        super().__init__()
        self.delay_s = delay_s

    async def set(self, key: str, value: bytes, ttl_s: float, *, only_new: bool = False) -> bool:
        await asyncio.sleep(self.delay_s)
        return await super().set(key, value, ttl_s, only_new=only_new)


def test_another_replica_finds_a_future_as_soon_as_its_id_is_returned() -> None:
    """A client's first retrieve_future may reach the other gateway replica at once: the owner's
    pending record must already be there, or the future is answered 404 (lost)."""

    async def main() -> None:
        kv = _SlowKV(0.05)
        owner, other = FutureStore(kv, shared=True), FutureStore(kv, shared=True)
        await owner.start()
        await other.start()
        gate = asyncio.Event()

        async def run():
            await gate.wait()
            return "json", {"loss": 1.5}

        rec = await owner.submit(user_id=7, kind="forward_backward", run=run)
        seen = await other.find(rec.request_id, 7)  # no wait between the two
        assert not isinstance(seen, str), seen
        assert not seen.done.is_set()
        gate.set()
        done = await other.wait(seen, timeout=2.0)
        assert done is not None and done.json_result == {"loss": 1.5}
        await owner.aclose()
        await other.aclose()

    asyncio.run(main())


def test_a_future_runs_when_the_kv_refuses_its_pending_record() -> None:
    """The shared store is best effort: a submit during a Redis outage still runs and answers
    on its own replica."""

    async def main() -> None:
        kv = _RestartingKV()
        owner = FutureStore(kv, shared=True)
        await owner.start()
        kv.down = 1

        async def run():
            return "json", {"loss": 2.5}

        rec = await owner.submit(user_id=7, kind="forward_backward", run=run)
        assert kv.refused == 1
        done = await owner.wait(rec, timeout=2.0)
        assert done is not None and done.json_result == {"loss": 2.5}
        assert await kv.get(f"fut:{rec.request_id}") is not None  # mirrored once finished
        await owner.aclose()

    asyncio.run(main())
