"""The transport under the typed engine facades: which replica a call reaches, and how.

Owns: `EngineClient` (the engines of every base model; hands out the facades of
gateway/engine_client/facades.py, which are the gateway's only way to call the engine) and
`pick_replica`. Two transports: Ray Serve
deployment handles (production) and in-process engine objects (tests, a single-process server).
Engine errors come back as the engine's own (picklable) exceptions; Ray wraps them in
`RayTaskError`, which we unwrap here so the gateway maps one hierarchy to HTTP. A replica that dies
mid-call (Ray's ``RayActorError`` family) becomes `ReplicaLostError`, whose message says what the
client should do (resume from its last checkpoint), instead of an anonymous internal error.
Every engine error leaves here without the server paths its message names
(`gateway.errors.without_server_paths`), so no answer, future or stream shows them.

Replicas: a role may have several replicas (``engines[base]["trainer"]`` is then a list, one
single-replica Serve deployment each, see engine/app.py). An adapter lives in one Trainer replica,
so every call about a model must reach the same one: we route by rendezvous hashing of the model
id, which each `TrainerClient` method names explicitly (a native model's adapter runs route with
their native model, `engine.rules.trainer_route_key`, since its Trainer replica hosts them
all). Sampler calls route by their ``affinity`` key (a sampling session id, an adapter path) the
same way, so a session sticks to one replica and its adapter stays in that replica's cache;
calls without a key go to any replica. Ray Serve's own routing cannot do this: its replicas are
interchangeable and its model-multiplexing routing is best effort (a new key's first requests can
land anywhere).

A dead Trainer replica fails its models' calls at once instead of after its restart
(`gateway.engine_client.replica_loss.ReplicaLoss`).
"""

from __future__ import annotations

import hashlib
import logging
import random
from collections.abc import AsyncIterator
from typing import Any, Literal, NoReturn

from engine.errors import EngineError
from engine.rules import trainer_route_key
from gateway.engine_client.facades import EveryReplica, SamplerClient, TrainerClient
from gateway.engine_client.replica_loss import NO_STATE, ReplicaLoss, replica_lost
from gateway.errors import without_server_paths
from gateway.futures.kv import KV

Role = Literal["trainer", "sampler"]
log = logging.getLogger(__name__)


def pick_replica(n: int, key: str | None) -> int:
    """Rendezvous (highest random weight) hashing: the same key always gets the same replica of
    ``n``; a key moves only if its replica is removed. No key: a random replica."""
    if n == 1:
        return 0
    if not key:
        return random.randrange(n)
    scores = [hashlib.sha256(f"{i}\x00{key}".encode()).digest() for i in range(n)]
    return max(range(n), key=scores.__getitem__)


class EngineClient:
    def __init__(self, engines: dict[str, dict[str, Any]], *, ray_handles: bool) -> None:
        """``engines[base_model] = {"trainer": target, "sampler": target}``; a target is an
        in-process object or a Serve handle, or a list of them (one per replica)."""
        self._engines = engines
        self._ray = ray_handles
        self._loss = ReplicaLoss()

    def share_replica_deaths(self, kv: KV | None) -> None:
        """Tell other gateway replicas about Trainer deaths through ``kv`` (Redis), and hear
        theirs; None stops."""
        self._loss.kv = kv

    async def aclose(self) -> None:
        """Finish publishing Trainer deaths (before the KV closes)."""
        await self._loss.aclose()

    @property
    def base_models(self) -> list[str]:
        return list(self._engines)

    def serves(self, base_model: str) -> bool:
        return base_model in self._engines

    def replicas(self, base_model: str, role: Role) -> list[Any]:
        """The raw targets of ``role`` (in-process objects or Serve handles), in replica order."""
        target = self._engines[base_model][role]
        return list(target) if isinstance(target, list | tuple) else [target]

    # -- the typed facades: the gateway's only way to call the engine ---------------------------
    def trainer(self, base_model: str) -> TrainerClient:
        """The Trainer of ``base_model``; each call goes to the replica holding its model."""
        return TrainerClient(self, base_model)

    def sampler(self, base_model: str, *, affinity: str | None = None) -> SamplerClient:
        """A Sampler replica of ``base_model``; clients with the same ``affinity`` (a sampling
        session id, an adapter path) reach the same replica, None any replica."""
        return SamplerClient(self, base_model, affinity)

    def every_trainer(self, base_model: str) -> EveryReplica:
        """Every Trainer replica of ``base_model`` (``info``, ``stats``: one answer each)."""
        return EveryReplica(self, self.replicas(base_model, "trainer"))

    def every_sampler(self, base_model: str) -> EveryReplica:
        """Every Sampler replica of ``base_model`` (one answer each)."""
        return EveryReplica(self, self.replicas(base_model, "sampler"))

    # -- transport (used by the facades only) ---------------------------------------------------
    async def _trainer_call(
        self, base_model: str, model_id: str | None, method: str, args: tuple, kwargs: dict
    ) -> Any:
        """Call the Trainer replica that holds ``model_id`` (its route key,
        `engine.rules.trainer_route_key`); any replica without one (``info``)."""
        key = None if model_id is None else trainer_route_key(model_id)
        targets = self.replicas(base_model, "trainer")
        index = pick_replica(len(targets), key)
        call = self._call(targets[index], method, args, kwargs)
        if key is None or not self._ray or method in NO_STATE:
            return await call
        return await self._loss.call((base_model, index), key, method, call)

    def _sampler_target(self, base_model: str, affinity: str | None) -> Any:
        targets = self.replicas(base_model, "sampler")
        return targets[pick_replica(len(targets), affinity)]

    async def _stream(
        self, target: Any, method: str, args: tuple, kwargs: dict
    ) -> AsyncIterator[Any]:
        """Iterate an async-generator method of ``target`` (Ray Serve: a streaming call)."""
        try:
            if not self._ray:
                async for item in getattr(target, method)(*args, **kwargs):
                    yield item
                return
            gen = getattr(target.options(stream=True), method).remote(*args, **kwargs)
            try:
                async for item in gen:
                    yield item
            except Exception as exc:
                _reraise_engine_error(exc)
                _reraise_replica_lost(exc, method)
                raise
        except EngineError as exc:
            _reraise_public(exc, method)

    async def _call(self, target: Any, method: str, args: tuple, kwargs: dict) -> Any:
        try:
            if not self._ray:
                return await getattr(target, method)(*args, **kwargs)
            try:
                return await getattr(target, method).remote(*args, **kwargs)
            except Exception as exc:
                _reraise_engine_error(exc)
                _reraise_replica_lost(exc, method)
                raise
        except EngineError as exc:
            _reraise_public(exc, method)


#: Ray's errors for "the actor is gone or unreachable" (ray.exceptions; matched by name so the
#: gateway imports no Ray module for it). ActorDiedError subclasses RayActorError.
_REPLICA_LOST = {"RayActorError", "ActorDiedError", "ActorUnavailableError"}


def _reraise_replica_lost(exc: Exception, method: str) -> None:
    """A Ray actor-death error as `ReplicaLostError` with what to do (raises), else return."""
    if not any(c.__name__ in _REPLICA_LOST for c in type(exc).__mro__):
        return
    unavailable = any(c.__name__ == "ActorUnavailableError" for c in type(exc).__mro__)
    died = None if unavailable else str(getattr(exc, "actor_id", None) or "")
    raise replica_lost(method, died) from None


def _reraise_public(exc: EngineError, method: str) -> NoReturn:
    """Raise ``exc`` without the server paths its message names (`without_server_paths`): every
    answer, future and stream of the gateway gets its text from here. The original, paths and
    all, is logged and chained as the cause (server logs only; it is never pickled on)."""
    public = without_server_paths(exc)
    if public is exc:
        raise exc
    log.info("engine %s failed: %s", method, exc)
    raise public from exc


def _reraise_engine_error(exc: Exception) -> None:
    """Unwrap RayTaskError(cause) into the engine's own error (raises), else return."""
    cause = getattr(exc, "cause", None)
    if isinstance(cause, EngineError):
        raise cause from None
