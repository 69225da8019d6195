"""A finished future reaches the shared KV even when Redis refuses the first writes (restarting):
another gateway replica's retrieve_future then sees it finish instead of answering try_again until
the pending record expires a day later (gateway/futures/store.py, `_mirror_finished`)."""

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

        rec = owner.submit(user_id=7, kind="forward_backward", run=run)
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
