"""The gateway's only path to the engine.

`EngineClient` routes a call to the Trainer or Sampler of a base model. Two transports: Ray Serve
deployment handles (production) and in-process engine objects (tests, a single-process server).
Engine errors come back as the engine's own (picklable) exceptions; Ray wraps them in
`RayTaskError`, which we unwrap here so the gateway maps one hierarchy to HTTP. A replica that dies
mid-call (Ray's ``RayActorError`` family) becomes `ReplicaLostError`, whose message says what the
client should do (resume from its last checkpoint), instead of an anonymous internal error.

Replicas: a role may have several replicas (``engines[base]["trainer"]`` is then a list, one
single-replica Serve deployment each, see engine/app.py). An adapter lives in one Trainer replica,
so every call about a model must reach the same one: we route by rendezvous hashing of the model
id (the first argument of every per-model Trainer method; a native model's adapter runs route with
their native model, `engine.protocol.trainer_route_key`, since its Trainer replica hosts them
all). Sampler calls route by their ``affinity`` key (a sampling session id, an adapter path) the
same way, so a session sticks to one replica and its adapter stays in that replica's cache;
calls without a key go to any replica. Ray Serve's own routing cannot do this: its replicas are
interchangeable and its model-multiplexing routing is best effort (a new key's first requests can
land anywhere).

A dead Trainer replica fails its models' calls at once instead of after its restart
(`gateway.replica_loss.ReplicaLoss`).
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import AsyncIterator
from typing import Any

from engine.errors import EngineError
from engine.protocol import trainer_route_key
from gateway.futures.kv import KV
from gateway.replica_loss import NO_STATE, ReplicaLoss, replica_lost


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

    def replicas(self, base_model: str, role: str) -> list[Any]:
        target = self._engines[base_model][role]
        return list(target) if isinstance(target, list | tuple) else [target]

    def _target(self, base_model: str, role: str, key: str | None) -> Any:
        targets = self.replicas(base_model, role)
        return targets[pick_replica(len(targets), key)]

    async def trainer(self, base_model: str, method: str, *args: Any) -> Any:
        """Call the Trainer replica that holds the model named by ``args[0]`` (any replica for
        calls without a model id, e.g. ``info``)."""
        key = trainer_route_key(args[0]) if args and isinstance(args[0], str) else None
        targets = self.replicas(base_model, "trainer")
        index = pick_replica(len(targets), key)
        if key is None or not self._ray or method in NO_STATE:
            return await self._call(targets[index], method, args)
        return await self._loss.call(
            (base_model, index), key, method, self._call(targets[index], method, args)
        )

    async def trainer_all(self, base_model: str, method: str, *args: Any) -> list[Any]:
        """Call every Trainer replica (e.g. ``stats``), in replica order."""
        return [await self._call(t, method, args) for t in self.replicas(base_model, "trainer")]

    async def sampler_all(self, base_model: str, method: str, *args: Any) -> list[Any]:
        """Call every Sampler replica, in replica order."""
        return [await self._call(t, method, args) for t in self.replicas(base_model, "sampler")]

    async def sampler(
        self, base_model: str, method: str, *args: Any, affinity: str | None = None
    ) -> Any:
        """Call a Sampler replica; calls with the same ``affinity`` reach the same replica."""
        return await self._call(self._target(base_model, "sampler", affinity), method, args)

    async def sampler_stream(
        self, base_model: str, method: str, *args: Any, affinity: str | None = None
    ) -> AsyncIterator[Any]:
        """Iterate an async-generator method of the Sampler (Ray Serve: a streaming call)."""
        target = self._target(base_model, "sampler", affinity)
        if not self._ray:
            async for item in getattr(target, method)(*args):
                yield item
            return
        gen = getattr(target.options(stream=True), method).remote(*args)
        try:
            async for item in gen:
                yield item
        except Exception as exc:
            _reraise_engine_error(exc)
            _reraise_replica_lost(exc, method)
            raise

    async def _call(self, target: Any, method: str, args: tuple) -> Any:
        if not self._ray:
            return await getattr(target, method)(*args)
        try:
            return await getattr(target, method).remote(*args)
        except Exception as exc:
            _reraise_engine_error(exc)
            _reraise_replica_lost(exc, method)
            raise


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


def _reraise_engine_error(exc: Exception) -> None:
    """Unwrap RayTaskError(cause) into the engine's own error (raises), else return."""
    cause = getattr(exc, "cause", None)
    if isinstance(cause, EngineError):
        raise cause from None
