"""A tiny async key-value store with per-key expiry, shared by gateway replicas when Redis is set.

Owns: `MemoryKV` (one process; the default) and `RedisKV` (``TWINKLE_REDIS_URL``), behind the same
four methods. Values are bytes; keys are strings. Used by the future store (futures outlive a
gateway replica) and by the idempotency-key cache (a retried POST reaching another replica gets the
first answer).
"""

from __future__ import annotations

import time
from typing import Protocol


class KV(Protocol):
    async def get(self, key: str) -> bytes | None: ...

    async def set(self, key: str, value: bytes, ttl_s: float, *, only_new: bool = False) -> bool:
        """Store ``value`` for ``ttl_s`` seconds; with ``only_new`` only if the key is absent.
        True when stored."""
        ...

    async def delete(self, key: str) -> None: ...

    async def aclose(self) -> None: ...


class MemoryKV:
    """In-process; expired keys are dropped lazily and by a sweep every 1024 writes."""

    def __init__(self) -> None:
        self._data: dict[str, tuple[bytes, float]] = {}
        self._writes = 0

    async def get(self, key: str) -> bytes | None:
        item = self._data.get(key)
        if item is None:
            return None
        if item[1] <= time.monotonic():
            self._data.pop(key, None)
            return None
        return item[0]

    async def set(self, key: str, value: bytes, ttl_s: float, *, only_new: bool = False) -> bool:
        if only_new and await self.get(key) is not None:
            return False
        self._data[key] = (value, time.monotonic() + ttl_s)
        self._writes += 1
        if self._writes % 1024 == 0:
            now = time.monotonic()
            for k in [k for k, (_, exp) in self._data.items() if exp <= now]:
                self._data.pop(k, None)
        return True

    async def delete(self, key: str) -> None:
        self._data.pop(key, None)

    async def aclose(self) -> None:
        self._data.clear()


class RedisKV:
    """Redis (``redis.asyncio``); every key is prefixed so one Redis can serve several deploys."""

    def __init__(self, url: str, prefix: str = "twinkle:") -> None:
        import redis.asyncio as aioredis

        # Bounded and blocking, as the quota store's pool (gateway/quotas/store.py): a burst of 50
        # requests each doing idempotency lookups opened 50 connections at once and, on a loaded
        # 2-core host, timed out connecting; waiting for one of 32 pooled connections does not.
        pool = aioredis.BlockingConnectionPool.from_url(
            url, max_connections=32, timeout=30, socket_connect_timeout=30, socket_timeout=30
        )
        self._r = aioredis.Redis(connection_pool=pool)
        self._prefix = prefix

    async def get(self, key: str) -> bytes | None:
        value = await self._r.get(self._prefix + key)
        return value.encode() if isinstance(value, str) else value  # a pool without decoding

    async def set(self, key: str, value: bytes, ttl_s: float, *, only_new: bool = False) -> bool:
        ms = max(1, int(ttl_s * 1000))
        return bool(await self._r.set(self._prefix + key, value, px=ms, nx=only_new))

    async def delete(self, key: str) -> None:
        await self._r.delete(self._prefix + key)

    async def aclose(self) -> None:
        await self._r.aclose()


def make_kv(redis_url: str | None) -> KV:
    return RedisKV(redis_url) if redis_url else MemoryKV()
