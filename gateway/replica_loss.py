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
(the dead actor's id), and every gateway replica with calls waiting on that Trainer replica reads
the key once a second (one GET per Trainer replica per second, only while calls wait), so a call
that another gateway replica's death report dooms fails within about a second too.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
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
_UNREAD = b"\0unread"

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


class _Life:
    """One life of one Trainer replica, as this process saw it."""

    __slots__ = ("baseline", "dead", "poller", "waiting")

    def __init__(self, baseline: bytes | None) -> None:
        self.dead = False
        self.waiting: set[asyncio.Future] = set()  # each gets a result when this life ends
        self.baseline = baseline  # the shared death report when this life began
        self.poller: asyncio.Task | None = None


class ReplicaLoss:
    def __init__(self) -> None:
        self.kv: KV | None = None  # set when gateway replicas share a KV
        self._lives: dict[Target, _Life] = {}
        self._models: OrderedDict[str, _Life] = OrderedDict()
        self._last_death: dict[Target, bytes | None] = {}
        self._tasks: set[asyncio.Task] = set()

    async def call(self, target: Target, key: str, method: str, coro: Any) -> Any:
        """Await ``coro`` (a Trainer ``method`` call about model ``key`` on ``target``), failing
        it as soon as ``target`` is known dead."""
        life = self._lives.get(target)
        if life is None or life.dead:
            life = self._lives[target] = _Life(self._last_death.get(target, _UNREAD))
        seen = self._models.get(key)
        if seen is not None and seen.dead and method not in CREATES:
            coro.close()
            raise replica_lost(method, "")
        self._models[key] = life
        self._models.move_to_end(key)
        if len(self._models) > MAX_MODELS:
            self._models.popitem(last=False)
        task = asyncio.ensure_future(coro)
        doom = asyncio.get_running_loop().create_future()
        life.waiting.add(doom)
        if self.kv is not None and life.poller is None:
            life.poller = asyncio.ensure_future(self._poll(target, life))
        try:
            await asyncio.wait((task, doom), return_when=asyncio.FIRST_COMPLETED)
            if task.done():
                exc = task.exception()
                died = getattr(exc, "died", None) if isinstance(exc, ReplicaLostError) else None
                if died is not None:
                    self._end(target, life, died)
                return task.result()
            task.cancel()  # left to Serve it would wait for the replica's successor
            raise replica_lost(method, "")
        except asyncio.CancelledError:
            task.cancel()
            raise
        finally:
            life.waiting.discard(doom)
            doom.cancel()

    def _end(self, target: Target, life: _Life, died: str, *, heard: bool = False) -> None:
        if life.dead:
            return
        life.dead = True
        for doom in life.waiting:
            if not doom.done():
                doom.set_result(None)
        if not died:
            return  # Ray named no actor: nothing another replica could tell apart from old news
        self._last_death[target] = died.encode()
        if not heard and self.kv is not None:
            task = asyncio.ensure_future(self._publish(self.kv, target, died))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _publish(self, kv: KV, target: Target, died: str) -> None:
        try:
            await kv.set(_death_key(target), died.encode(), DEATH_TTL_S)
        except Exception:  # noqa: BLE001 - other replicas then hear of it from their own calls
            log.warning("could not publish a Trainer replica's death", exc_info=True)

    async def _poll(self, target: Target, life: _Life) -> None:
        """While calls wait on ``life``, end it when another gateway replica reports a death."""
        try:
            if life.baseline == _UNREAD and self.kv is not None:
                life.baseline = await self.kv.get(_death_key(target))
            while not life.dead and life.waiting:
                await asyncio.sleep(POLL_S)
                kv = self.kv
                if kv is None or life.dead or not life.waiting:
                    break
                seen = await kv.get(_death_key(target))
                if seen is not None and seen != life.baseline:
                    self._end(target, life, seen.decode(), heard=True)
        except Exception:  # noqa: BLE001 - a Redis blip: the next call starts a new poller
            log.warning("could not read Trainer replica deaths from the shared KV", exc_info=True)
        finally:
            life.poller = None

    async def aclose(self) -> None:
        for task in list(self._tasks):
            with contextlib.suppress(BaseException):
                await task


def _death_key(target: Target) -> str:
    return f"trainer-death:{target[0]}:{target[1]}"
