"""A gateway replica's lease in the shared KV: the liveness signal that takeover reads.

Owns: this replica's id, renewing its ``replica:<id>`` key every third of its TTL, telling whether
another replica's lease is still held, and dropping the lease on shutdown so other replicas take
over its pending futures at once instead of after the TTL.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid

from gateway.futures.kv import KV

log = logging.getLogger(__name__)

#: a replica's lease; a pending record whose owner's lease lapsed is taken over
LEASE_TTL_S = 5.0


class ReplicaLease:
    def __init__(self, kv: KV) -> None:
        self._kv = kv
        self.replica_id = uuid.uuid4().hex
        self._task: asyncio.Task | None = None

    @staticmethod
    def _key(replica_id: str) -> str:
        return f"replica:{replica_id}"

    async def start(self) -> None:
        """Take the lease and keep renewing it in the background (idempotent)."""
        if self._task is None:
            await self._renew()
            self._task = asyncio.get_running_loop().create_task(self._loop())

    async def _renew(self) -> None:
        await self._kv.set(self._key(self.replica_id), b"1", LEASE_TTL_S)

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(LEASE_TTL_S / 3)
            try:
                await self._renew()
            except Exception:  # Redis blip: keep trying; others take over only after the TTL
                log.warning("could not renew replica lease", exc_info=True)

    async def held(self, replica_id: str) -> bool:
        """Whether ``replica_id``'s lease is still in the KV (the replica is alive)."""
        return await self._kv.get(self._key(replica_id)) is not None

    async def aclose(self) -> None:
        """Stop renewing and drop the lease, so other replicas take over at once."""
        if self._task is None:
            return
        self._task.cancel()
        with contextlib.suppress(BaseException):
            await self._task
        self._task = None
        with contextlib.suppress(Exception):
            await self._kv.delete(self._key(self.replica_id))
