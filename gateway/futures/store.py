"""The future store: every asynchronous Tinker request gets a record here.

Owns: creating futures, running their engine coroutine, keeping the result (JSON or protobuf
bytes) or the error until it is retrieved or expires, long-polling, expiry (an expired future
answers 410, not 404, for a day after it expired), and idempotency: a retried submit with the same
(model_id, seq_id) or (sampling_session_id, seq_id) returns the original future, and the same key
with a different payload (its fingerprint) is a 409. A key is *claimed* before anything is charged
or submitted (`claim`): in this replica under the event loop (no await between the check and the
claim), across replicas with the KV's ``set(only_new=True)`` (Redis ``SET NX``); a second claimant
waits for the first one's future id instead of racing it. The record and claim types are in
`gateway.futures.record`.

Records live in this replica's memory (the coroutine and the long-poll event are local); when a
shared KV (Redis) is configured, records (pending and finished), expiry tombstones and the
idempotency index are mirrored there, so another gateway replica, or this one after a restart,
still answers retrieve_future and still dedupes a retried seq_id.

Takeover: each replica holds a lease key in the KV (`gateway.futures.lease`). A pending record
whose owner's lease is gone (the replica died or restarted) is taken over by the first replica
asked about it: if the record carries a *job* (`ReplayJob`: its engine call as JSON data, see
`gateway.tinker_api.jobs`), the new replica runs the job again, and the Trainer answers a repeated
(model_id, seq_id) with the first execution's result (engine/scheduling/exactly_once.py), so
nothing runs twice. A record without a job (sampling, saves) becomes expired: 410, which makes the
SDK resubmit a sample. How long a finished record stays, and its tombstone after that, is
`gateway.futures.retention`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from engine.errors import EngineError
from gateway.futures.kv import KV, MemoryKV
from gateway.futures.lease import ReplicaLease
from gateway.futures.record import Claim, FutureRecord, ReplayJob, Result, conflict, fingerprint
from gateway.futures.retention import RESULT_TTL_S, TOMBSTONE_TTL_S, Retention

__all__ = ["Claim", "FutureRecord", "FutureStore", "ReplayJob", "Result", "fingerprint"]

#: a future's work: a coroutine factory, run once in the background
Run = Callable[[], Awaitable[Result]]

log = logging.getLogger(__name__)

#: a pending record mirrored to the KV lives at most this long
PENDING_TTL_S = 86400.0
#: an idempotency claim not yet turned into a future. Claim → submit takes a DB write and a quota
#: charge (milliseconds); a replica that dies in between blocks the key for at most this long.
CLAIM_TTL_S = 60.0
#: how often a claimant polls the shared KV for another replica's claim to become a future
CLAIM_POLL_S = 0.02
#: waits between tries of mirroring a finished record (a Redis restart takes ~1 s; 31 s in all)
MIRROR_RETRY_S = (0.5, 1.0, 2.0, 4.0, 8.0, 16.0)
_CLAIM_PREFIX = b"claim:"


class FutureStore:
    def __init__(
        self, kv: KV | None = None, *, result_ttl_s: float = RESULT_TTL_S, shared: bool = False
    ) -> None:
        """``shared``: ``kv`` is visible to other replicas (Redis), so mirror records into it."""
        self._futures: dict[str, FutureRecord] = {}
        self._by_idem: dict[tuple[str, int], str] = {}
        self._claims: dict[tuple[str, int], Claim] = {}
        self._tasks: set[asyncio.Task] = set()
        self._kv = kv or MemoryKV()
        self._shared = shared
        self._retention = Retention(result_ttl_s)
        self._lease = ReplicaLease(self._kv)
        #: builds the coroutine of a job (set by the app: it needs the engine client)
        self.job_runner: Callable[[ReplayJob], Run] | None = None
        #: awaited once a future that carries ``extra["trace"]`` finishes (set by the app: it
        #: writes the session trace row, gateway/runs/request_log.py)
        self.on_finish: Callable[[FutureRecord], Awaitable[None]] | None = None
        self.takeovers = 0

    def pending_count(self) -> int:
        """Futures this replica holds that have not finished (the ``twinkle_futures_pending``
        gauge; other replicas' futures are counted by their own /metrics)."""
        return sum(1 for r in self._futures.values() if not r.done.is_set())

    @property
    def replica_id(self) -> str:
        return self._lease.replica_id

    @property
    def result_ttl_s(self) -> float:
        return self._retention.result_ttl_s

    def uncollected_count(self) -> int:
        """Finished futures of this replica whose result (or error) no retrieve_future has
        answered yet; a draining server gives their clients a moment to collect them."""
        return self._retention.uncollected_count()

    def collected(self, request_id: str) -> None:
        """A retrieve_future answered this future's result or error."""
        self._retention.collected(request_id)

    async def start(self) -> None:
        """Start holding this replica's lease (shared mode only)."""
        if self._shared:
            await self._lease.start()

    async def _maybe_take_over(self, rec: FutureRecord) -> FutureRecord | str:
        """``rec`` (pending, owned elsewhere) is taken over if its owner's lease lapsed: re-run
        locally (a job), or expired (no job). Returns the record to use, or ``"expired"``."""
        if rec.done.is_set() or rec.owner is None or rec.owner == self.replica_id:
            return rec
        if await self._lease.held(rec.owner):
            return rec
        won = await self._kv.set(
            f"takeover:{rec.request_id}", self.replica_id.encode(), 60.0, only_new=True
        )
        if not won:
            return rec  # another replica is taking it over; keep polling the shared record
        self.takeovers += 1
        if rec.job is None or self.job_runner is None:
            log.warning(
                "future %s (%s) lost with its replica; answering 410", rec.request_id, rec.kind
            )
            await self._kv.delete(f"fut:{rec.request_id}")
            await self._kv.set(f"gone:{rec.request_id}", str(rec.user_id).encode(), TOMBSTONE_TTL_S)
            return "expired"
        log.info("taking over future %s (%s) from replica %s", rec.request_id, rec.kind, rec.owner)
        rec.owner = self.replica_id
        self._futures[rec.request_id] = rec
        if rec.idem_key is not None:
            self._by_idem[rec.idem_key] = rec.request_id
        self._start(rec, self.job_runner(rec.job))
        return rec

    # -- idempotency -------------------------------------------------------------------------------
    async def lookup_idempotent(
        self, key: tuple[str, int], fp: str | None = None
    ) -> FutureRecord | None:
        """The future already submitted under ``key``, or None. A different payload under the same
        key is a 409: a seq_id names one request, a retry must resend the same one."""
        self._expire()
        rid = self._by_idem.get(key)
        rec = self._futures.get(rid) if rid else None
        if rec is None and self._shared:
            raw_rid = await self._kv.get(self._idem_kv(key))
            if raw_rid is not None and not raw_rid.startswith(_CLAIM_PREFIX):
                rec = await self._load(raw_rid.decode())
        if rec is None:
            return None
        if fp is not None and rec.fingerprint is not None and fp != rec.fingerprint:
            raise conflict(key)
        return rec

    async def claim(self, key: tuple[str, int], fp: str | None) -> FutureRecord | Claim:
        """The future already submitted under ``key`` (same payload; another payload is a 409), or
        a `Claim`: the caller alone may now charge and `submit(claim=...)`, or must `release` it.

        A claimant that finds the key claimed but not yet submitted waits for that future id (or
        for a release, then claims again) rather than racing it."""
        while True:
            rec = await self.lookup_idempotent(key, fp)
            if rec is not None:
                return rec
            held = self._claims.get(key)
            if held is not None:  # claimed in this replica: wait for its future id or release
                if fp is not None and held.fp is not None and fp != held.fp:
                    raise conflict(key)
                await asyncio.shield(held.settled)
                continue
            # No await since the lookup above: check-and-claim is atomic within this replica.
            mine = Claim(key, fp)
            self._claims[key] = mine
            if not self._shared:
                return mine
            marker = _CLAIM_PREFIX + (fp or "").encode()
            try:
                won = await self._kv.set(self._idem_kv(key), marker, CLAIM_TTL_S, only_new=True)
            except BaseException:
                self._settle(mine, None)
                raise
            if won:
                return mine
            self._settle(mine, None)  # another replica holds the key: wait for it, then look again
            await self._await_remote_claim(key, fp)

    async def _await_remote_claim(self, key: tuple[str, int], fp: str | None) -> None:
        """Poll the shared KV until another replica's claim on ``key`` becomes a future id or goes
        away (released, or expired after CLAIM_TTL_S)."""
        while True:
            raw = await self._kv.get(self._idem_kv(key))
            if raw is None or not raw.startswith(_CLAIM_PREFIX):
                return
            theirs = raw[len(_CLAIM_PREFIX) :].decode()
            if fp is not None and theirs and theirs != fp:
                raise conflict(key)
            await asyncio.sleep(CLAIM_POLL_S)

    async def release(self, claim: Claim) -> None:
        """Give a claim up without a future (the request failed before submit, e.g. a 429): the
        next retry of the key claims it afresh."""
        self._settle(claim, None)
        if self._shared:
            with contextlib.suppress(Exception):  # else the marker expires after CLAIM_TTL_S
                await self._kv.delete(self._idem_kv(claim.key))

    def _settle(self, claim: Claim, request_id: str | None) -> None:
        if self._claims.get(claim.key) is claim:
            del self._claims[claim.key]
        if not claim.settled.done():
            claim.settled.set_result(request_id)

    @staticmethod
    def _idem_kv(key: tuple[str, int]) -> str:
        return f"idem:{key[0]}:{key[1]}"

    # -- lookup ------------------------------------------------------------------------------------
    async def find(self, request_id: str, user_id: int) -> FutureRecord | str:
        """The future if it exists and belongs to ``user_id``; else ``"expired"`` (it existed and
        expired) or ``"missing"`` (unknown, or another user's: ids leak nothing)."""
        self._expire()
        rec = self._futures.get(request_id)
        if rec is None and self._shared:
            rec = await self._load(request_id)
        if rec is not None and rec.user_id == user_id and self._shared:
            return await self._maybe_take_over(rec)
        if rec is not None:
            return rec if rec.user_id == user_id else "missing"
        tomb = self._retention.tombstones.get(request_id)
        if tomb is None and self._shared:
            raw = await self._kv.get(f"gone:{request_id}")
            tomb = (int(raw), 0.0) if raw is not None else None
        if tomb is not None and tomb[0] == user_id:
            return "expired"
        return "missing"

    def get(self, request_id: str, user_id: int) -> FutureRecord | None:
        """Local-only lookup (tests, in-process callers)."""
        rec = self._futures.get(request_id)
        return rec if rec is not None and rec.user_id == user_id else None

    async def _load(self, request_id: str) -> FutureRecord | None:
        raw = await self._kv.get(f"fut:{request_id}")
        return FutureRecord.from_bytes(raw) if raw is not None else None

    # -- submit / run ------------------------------------------------------------------------------
    async def submit(
        self,
        *,
        user_id: int,
        kind: str,
        run: Run,
        job: ReplayJob | None = None,
        idem_key: tuple[str, int] | None = None,
        extra: dict[str, Any] | None = None,
        fp: str | None = None,
        claim: Claim | None = None,
    ) -> FutureRecord:
        """Create a future and start ``run`` in the background. ``job``: the same work as data,
        which another replica runs again if this one dies first (takeover); None: the future
        expires with this replica instead. With ``claim`` (from `claim`), the future is the one
        of the claimed key. Shared mode: returns once the pending record is in the shared KV (one
        SET), so a retrieve_future that reaches another replica first finds it instead of
        answering 404 for a future that exists."""
        self._expire()
        if claim is not None:
            idem_key, fp = claim.key, claim.fp
        rec = FutureRecord(
            request_id=f"req-{uuid.uuid4().hex}",
            user_id=user_id,
            kind=kind,
            idem_key=idem_key,
            fingerprint=fp,
            extra=extra or {},
            owner=self.replica_id,
            job=job,
        )
        self._futures[rec.request_id] = rec
        if idem_key is not None:
            self._by_idem[idem_key] = rec.request_id
        if claim is not None:
            self._settle(claim, rec.request_id)
        mirrored = False
        try:
            mirrored = await self._mirror(rec)  # before the client hears the id
        finally:  # started even if this request is cancelled: the key's claim is settled
            self._start(rec, run, mirror_first=not mirrored)
        return rec

    def _start(self, rec: FutureRecord, run: Run, *, mirror_first: bool = True) -> None:
        task = asyncio.get_running_loop().create_task(self._drive(rec, run, mirror_first))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _mirror(self, rec: FutureRecord) -> bool:
        """Write ``rec`` to the shared KV; False if that failed (logged)."""
        if not self._shared:
            return True
        try:
            ttl = self.result_ttl_s if rec.done.is_set() else PENDING_TTL_S
            await self._kv.set(f"fut:{rec.request_id}", rec.to_bytes(), ttl)
            if rec.idem_key is not None:
                # A plain set: this replica claimed the key (`claim`), so it overwrites its own
                # claim marker with the future id (record first, so a reader finds it).
                await self._kv.set(self._idem_kv(rec.idem_key), rec.request_id.encode(), ttl)
            if rec.done.is_set():
                await self._kv.set(
                    f"gone:{rec.request_id}", str(rec.user_id).encode(), ttl + TOMBSTONE_TTL_S
                )
        except Exception:  # the shared store is best effort; this replica still answers
            log.exception("could not mirror future %s to the shared store", rec.request_id)
            return False
        return True

    async def _mirror_finished(self, rec: FutureRecord) -> None:
        """Mirror a finished record, retrying: other replicas answer its retrieve_future from the
        KV, and without this write they would see it pending (try_again) until PENDING_TTL_S."""
        for delay in MIRROR_RETRY_S:
            if await self._mirror(rec):
                return
            await asyncio.sleep(delay)
        await self._mirror(rec)

    async def _drive(self, rec: FutureRecord, run: Run, mirror_first: bool) -> None:
        if mirror_first:
            await self._mirror(rec)
        try:
            fmt, value = await run()
            if fmt == "proto":
                rec.proto_result = value
            else:
                rec.json_result = value
        except EngineError as exc:
            rec.error, rec.category = str(exc), exc.category
        except asyncio.CancelledError:
            # Shutting down. Shared mode: leave the record pending; a replica takes it over.
            rec.error, rec.category = "request cancelled (server shutting down)", "server"
            self._retention.finish(rec)
            raise
        except Exception as exc:  # a server fault: never a hang, never a leaked traceback
            log.exception("future %s (%s) failed", rec.request_id, rec.kind)
            rec.error = f"internal error while running {rec.kind}: {type(exc).__name__}"
            rec.category = "server"
        # finished: nothing runs the job again, and a training job carries its request body
        # (up to the body cap, base64), which the record would keep for the result TTL (1 h)
        rec.job = None
        self._retention.finish(rec)
        await self._mirror_finished(rec)
        if self.on_finish is not None and rec.extra.get("trace"):
            try:
                await self.on_finish(rec)
            except Exception:  # a trace row is best effort; the future has its result already
                log.exception("could not record future %s in its session trace", rec.request_id)

    async def wait(self, rec: FutureRecord, timeout: float) -> FutureRecord | None:
        """Wait up to ``timeout`` seconds; the finished record, or None if still running. A record
        another replica runs is re-read from the shared store until it finishes."""
        if rec.done.is_set():
            return rec
        if rec.request_id in self._futures:
            try:
                await asyncio.wait_for(rec.done.wait(), timeout)
            except TimeoutError:
                return None
            return rec
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            await asyncio.sleep(min(0.2, max(0.0, deadline - time.monotonic())))
            fresh = await self._load(rec.request_id)
            if fresh is None:
                return None  # expired or taken away: the next poll says which
            if fresh.done.is_set():
                return fresh
            taken = await self._maybe_take_over(fresh)
            if isinstance(taken, FutureRecord) and taken.request_id in self._futures:
                return await self.wait(taken, max(0.0, deadline - time.monotonic()))
            if taken == "expired":
                return None
        return None

    def _expire(self) -> None:
        self._retention.expire(self._futures, self._by_idem)

    async def aclose(self) -> None:
        await self._lease.aclose()
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._kv.aclose()
