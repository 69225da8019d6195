"""Calls about a dead Trainer replica fail at once, not after Serve has replaced it.

Owns: `ReplicaLoss` (which life of which Trainer replica each model's calls went to) and
`replica_lost` (the error and its message).

Why: Ray Serve retries a call that had not yet reached a replica when that replica died (its
router's slot reservation fails) on the replica it starts next. A step submitted just after a kill
therefore waited for the restart, 36 s on a loaded 2-core CI host, only to hear from the new
replica that the adapter is not loaded. Once a call fails because its Trainer replica died, that
replica's *life* ends here: calls still waiting on it and later calls about models whose calls went
to it fail with `ReplicaLostError` at once. A model made after the death lives on the new replica
and is not affected; making a model again (a native model's id repeats within its session) is
allowed. `ActorUnavailableError` (the actor may be alive and still hold the adapter) ends nothing.

Several gateway replicas: with a shared KV (Redis) a death is published under the replica's key
as ``<dead actor's id>@<wall time it was seen>``, and every gateway replica with calls waiting on
that Trainer replica reads the key once a second (one GET per Trainer replica per second, only
while calls wait), so a call that another gateway replica's death report dooms fails within about a
second too. A report dooms only the calls and models that replica had started before the death
was seen: a replica that saw nothing itself keeps using the life the report ends until its next
read, and what it started there after the death went to the new Trainer replica (else a tenant
resuming through such a replica would have its new model's load_state failed by the replica's
next read of that report). A call also reads the key before it starts when the last read is
over a second old, so a new life's baseline is the report as it stood when the life began.
Sparing rather than failing a call in doubt costs at worst the slow path (the new replica says
the adapter is not loaded); failing it wrongly would be an error the tenant did nothing to cause.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections import OrderedDict
from typing import Any

from engine.errors import ReplicaLostError
from gateway.futures.kv import KV

log = logging.getLogger(__name__)

#: Trainer calls that make a model, and calls that need none of a model's state (cleanup, queue
#: status): neither fails fast after a death
CREATES = frozenset({"create_adapter", "native_create"})
NO_STATE = frozenset({"status", "delete_adapter", "native_close"})
#: how often calls waiting on a Trainer replica look for another gateway replica's death report
POLL_S = 1.0
#: a published death is kept this long (a gateway replica started later reads it as its baseline)
DEATH_TTL_S = 86400.0
#: models remembered, least recently used dropped first: a forgotten model's call after a death
#: waits for the new replica and fails there (its adapter is not loaded), as without this module
MAX_MODELS = 65536
_UNREAD = "\0unread"

Target = tuple[str, int]  # (base model, Trainer replica index)


def replica_lost(method: str, died: str | None) -> ReplicaLostError:
    """The error of a call whose replica died (``died``: the actor's id, ``""`` when Ray did not
    say) or could not be reached (``died`` None)."""
    err = ReplicaLostError(
        f"the engine replica running {method} stopped before answering (it is being restarted); "
        "state it held in memory since your last save is lost: load your last checkpoint "
        "(create_training_client_from_state / load_state) and resubmit from there"
    )
    err.died = died
    return err


def _report(actor: str, seen_at: float) -> bytes:
    return f"{actor}@{seen_at:.6f}".encode()


def _parse(raw: bytes | None) -> tuple[str | None, float]:
    """(dead actor's id, wall time it was seen) of a published report; a report without a time
    (an older gateway's) dooms everything started before it was read."""
    if raw is None:
        return None, -math.inf
    actor, _, at = raw.decode(errors="replace").rpartition("@")
    try:
        return actor, float(at)
    except ValueError:
        return raw.decode(errors="replace"), math.inf


class _Life:
    """One life of one Trainer replica, as this process saw it."""

    __slots__ = ("baseline", "checked", "checking", "dead", "died_at", "poller", "waiting")

    def __init__(self, baseline: str | None) -> None:
        self.dead = False
        self.died_at = math.inf  # wall time the death was seen: what started before it is lost
        self.waiting: dict[asyncio.Future, float] = {}  # doom -> its call's wall start time
        self.baseline = baseline  # the dead actor the shared report named when this life began
        self.poller: asyncio.Task | None = None
        self.checked = -math.inf  # monotonic time of the last read of the shared report
        self.checking: asyncio.Future | None = None  # a read in flight, shared by calls

    def lost(self, started: float) -> bool:
        """Whether something started at wall time ``started`` on this life is gone."""
        return self.dead and started <= self.died_at


class ReplicaLoss:
    def __init__(self) -> None:
        self.kv: KV | None = None  # set when gateway replicas share a KV
        self._lives: dict[Target, _Life] = {}
        self._models: OrderedDict[str, tuple[_Life, float]] = OrderedDict()  # -> (life, bound at)
        self._last_death: dict[Target, str] = {}
        self._tasks: set[asyncio.Task] = set()

    async def call(self, target: Target, key: str, method: str, coro: Any) -> Any:
        """Await ``coro`` (a Trainer ``method`` call about model ``key`` on ``target``), failing
        it as soon as ``target`` is known dead."""
        try:
            life = await self._checked_life(target)
        except BaseException:
            coro.close()  # cancelled while reading the report: the call never started
            raise
        started = time.time()
        seen = self._models.get(key)
        if seen is not None and seen[0].lost(seen[1]) and method not in CREATES:
            coro.close()
            raise replica_lost(method, "")
        if seen is None or seen[0] is not life:
            self._models[key] = (life, started)
        self._models.move_to_end(key)
        if len(self._models) > MAX_MODELS:
            self._models.popitem(last=False)
        task = asyncio.ensure_future(coro)
        doom = asyncio.get_running_loop().create_future()
        life.waiting[doom] = started
        if self.kv is not None and life.poller is None:
            life.poller = asyncio.ensure_future(self._poll(target, life))
        try:
            await asyncio.wait((task, doom), return_when=asyncio.FIRST_COMPLETED)
            if task.done():
                exc = task.exception()
                died = getattr(exc, "died", None) if isinstance(exc, ReplicaLostError) else None
                if died is not None:
                    self._end(target, life, died, time.time())
                return task.result()
            task.cancel()  # left to Serve it would wait for the replica's successor
            raise replica_lost(method, "")
        except asyncio.CancelledError:
            task.cancel()
            raise
        finally:
            life.waiting.pop(doom, None)
            doom.cancel()

    def _end(
        self, target: Target, life: _Life, died: str, seen_at: float, *, heard: bool = False
    ) -> None:
        if life.dead:
            return
        life.dead, life.died_at = True, seen_at
        for doom, started in life.waiting.items():
            if started <= seen_at and not doom.done():
                doom.set_result(None)
        if not died:
            # Ray named no actor: nothing another replica could tell apart from old news; the
            # next life reads the shared report afresh rather than keep an older death's
            self._last_death.pop(target, None)
            return
        self._last_death[target] = died
        if not heard and self.kv is not None:
            task = asyncio.ensure_future(self._publish(self.kv, target, _report(died, seen_at)))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _publish(self, kv: KV, target: Target, report: bytes) -> None:
        try:
            await kv.set(_death_key(target), report, DEATH_TTL_S)
        except Exception:  # noqa: BLE001 - other replicas then hear of it from their own calls
            log.warning("could not publish a Trainer replica's death", exc_info=True)

    def _life(self, target: Target) -> _Life:
        life = self._lives.get(target)
        if life is None or life.dead:
            life = self._lives[target] = _Life(self._last_death.get(target, _UNREAD))
        return life

    async def _checked_life(self, target: Target) -> _Life:
        """The target's current life, after reading the shared death report when the last read
        is over `POLL_S` old (calls starting together share one read)."""
        life = self._life(target)
        kv = self.kv
        if kv is None:
            return life
        if life.checking is None and time.monotonic() - life.checked >= POLL_S:
            life.checking = asyncio.ensure_future(self._read(kv, target, life))
        if life.checking is not None:
            await asyncio.shield(life.checking)
        return self._life(target)

    async def _read(self, kv: KV, target: Target, life: _Life) -> None:
        try:
            raw = await kv.get(_death_key(target))
        except Exception:  # noqa: BLE001 - a Redis blip: calls go on, the poller reads again
            log.warning("could not read Trainer replica deaths from the shared KV", exc_info=True)
            return
        finally:
            life.checked = time.monotonic()
            life.checking = None
        actor, seen_at = _parse(raw)
        if life.baseline == _UNREAD:
            life.baseline = actor
        elif actor is not None and actor != life.baseline:
            self._end(target, life, actor, seen_at, heard=True)

    async def _poll(self, target: Target, life: _Life) -> None:
        """While calls wait on ``life``, end it when another gateway replica reports a death."""
        try:
            while not life.dead and life.waiting:
                await asyncio.sleep(POLL_S)
                kv = self.kv
                if kv is None or life.dead or not life.waiting:
                    break
                if life.checking is None:
                    life.checking = asyncio.ensure_future(self._read(kv, target, life))
                await asyncio.shield(life.checking)
        finally:
            life.poller = None

    async def aclose(self) -> None:
        for task in list(self._tasks):
            with contextlib.suppress(BaseException):
                await task


def _death_key(target: Target) -> str:
    return f"trainer-death:{target[0]}:{target[1]}"
