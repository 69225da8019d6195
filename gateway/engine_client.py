"""The gateway's only path to the engine.

`EngineClient` routes a call to the Trainer or Sampler of a base model. Two transports: Ray Serve
deployment handles (production) and in-process engine objects (tests, a single-process server).
Engine errors come back as the engine's own (picklable) exceptions; Ray wraps them in
`RayTaskError`, which we unwrap here so the gateway maps one hierarchy to HTTP.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from engine.errors import EngineError


class EngineClient:
    def __init__(self, engines: dict[str, dict[str, Any]], *, ray_handles: bool) -> None:
        """``engines[base_model] = {"trainer": obj_or_handle, "sampler": obj_or_handle}``."""
        self._engines = engines
        self._ray = ray_handles

    @property
    def base_models(self) -> list[str]:
        return list(self._engines)

    def serves(self, base_model: str) -> bool:
        return base_model in self._engines

    async def trainer(self, base_model: str, method: str, *args: Any) -> Any:
        return await self._call(self._engines[base_model]["trainer"], method, args)

    async def sampler(self, base_model: str, method: str, *args: Any) -> Any:
        return await self._call(self._engines[base_model]["sampler"], method, args)

    async def sampler_stream(self, base_model: str, method: str, *args: Any) -> AsyncIterator[Any]:
        """Iterate an async-generator method of the Sampler (Ray Serve: a streaming call)."""
        target = self._engines[base_model]["sampler"]
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
            raise

    async def _call(self, target: Any, method: str, args: tuple) -> Any:
        if not self._ray:
            return await getattr(target, method)(*args)
        try:
            return await getattr(target, method).remote(*args)
        except Exception as exc:
            _reraise_engine_error(exc)
            raise


def _reraise_engine_error(exc: Exception) -> None:
    """Unwrap RayTaskError(cause) into the engine's own error (raises), else return."""
    cause = getattr(exc, "cause", None)
    if isinstance(cause, EngineError):
        raise cause from None
