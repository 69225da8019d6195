"""The future store: every asynchronous Tinker request gets a record here.

Owns: creating futures, running their engine coroutine, keeping the result (JSON or protobuf
bytes) or the error until it is retrieved or expires, long-polling, and idempotency (a retried
submit with the same (model_id, seq_id) or (sampling_session_id, seq_id) returns the original
future). In-process; a Redis-backed store can replace it behind the same methods.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from engine.errors import EngineError

log = logging.getLogger(__name__)

#: a finished future is kept this long for retrieval (the SDK retrieves within seconds)
RESULT_TTL_S = 3600.0


@dataclass
class FutureRecord:
    request_id: str
    user_id: int
    kind: str
    created: float = field(default_factory=time.monotonic)
    done: asyncio.Event = field(default_factory=asyncio.Event)
    finished_at: float | None = None
    json_result: dict[str, Any] | None = None
    proto_result: bytes | None = None
    error: str | None = None
    category: str = "server"
    idem_key: tuple[str, int] | None = None
    extra: dict[str, Any] = field(default_factory=dict)


#: the coroutine's return: ("json", dict) or ("proto", bytes)
Result = tuple[str, Any]


class FutureStore:
    def __init__(self) -> None:
        self._futures: dict[str, FutureRecord] = {}
        self._by_idem: dict[tuple[str, int], str] = {}
        self._tasks: set[asyncio.Task] = set()

    def lookup_idempotent(self, key: tuple[str, int]) -> FutureRecord | None:
        rid = self._by_idem.get(key)
        return self._futures.get(rid) if rid else None

    def get(self, request_id: str, user_id: int) -> FutureRecord | None:
        """The future, if it exists and belongs to ``user_id`` (else None: ids leak nothing)."""
        rec = self._futures.get(request_id)
        if rec is None or rec.user_id != user_id:
            return None
        return rec

    def submit(
        self,
        *,
        user_id: int,
        kind: str,
        run: Callable[[], Awaitable[Result]],
        idem_key: tuple[str, int] | None = None,
        extra: dict[str, Any] | None = None,
    ) -> FutureRecord:
        """Create a future and start ``run`` in the background."""
        self._expire()
        rec = FutureRecord(
            request_id=f"req-{uuid.uuid4().hex}",
            user_id=user_id,
            kind=kind,
            idem_key=idem_key,
            extra=extra or {},
        )
        self._futures[rec.request_id] = rec
        if idem_key is not None:
            self._by_idem[idem_key] = rec.request_id
        task = asyncio.get_running_loop().create_task(self._drive(rec, run))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return rec

    async def _drive(self, rec: FutureRecord, run: Callable[[], Awaitable[Result]]) -> None:
        try:
            fmt, value = await run()
            if fmt == "proto":
                rec.proto_result = value
            else:
                rec.json_result = value
        except EngineError as exc:
            rec.error, rec.category = str(exc), exc.category
        except asyncio.CancelledError:
            rec.error, rec.category = "request cancelled (server shutting down)", "server"
            raise
        except Exception as exc:  # a server fault: never a hang, never a leaked traceback
            log.exception("future %s (%s) failed", rec.request_id, rec.kind)
            rec.error = f"internal error while running {rec.kind}: {type(exc).__name__}"
            rec.category = "server"
        finally:
            rec.finished_at = time.monotonic()
            rec.done.set()

    async def wait(self, rec: FutureRecord, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds; True when the future is finished."""
        if rec.done.is_set():
            return True
        try:
            await asyncio.wait_for(rec.done.wait(), timeout)
        except TimeoutError:
            return False
        return True

    def _expire(self) -> None:
        now = time.monotonic()
        stale = [
            rid
            for rid, r in self._futures.items()
            if r.finished_at is not None and now - r.finished_at > RESULT_TTL_S
        ]
        for rid in stale:
            rec = self._futures.pop(rid)
            if rec.idem_key is not None:
                self._by_idem.pop(rec.idem_key, None)

    async def aclose(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
