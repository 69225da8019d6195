"""Limit on concurrent sampling requests (quota ``max_concurrent_samples``).

Owns `SamplingLimiter`, a thin front over `gateway.quotas.Quotas` (so the limit is per user and
per organization, atomic, and shared by gateway replicas through Redis), and the FastAPI
dependency `SamplingLimiterDep`. The per-user default is
``ServerConfig.max_concurrent_samples_per_user`` (0 = no limit) unless
``gateway.default_user_quotas`` or a per-user override says otherwise. A request over the limit
gets `RateLimitedError` (429 with ``retry-after``); the Tinker SDK backs off and retries the same
seq_id, OpenAI clients retry 429 too.

Usage: ``async with limiter.acquire(who): ...`` holds one slot for the block, or
``slot = await limiter.acquire(who)`` … ``await slot.release()`` when the work outlives the
request (the Tinker ``asample`` future). ``release`` is idempotent.
"""

from __future__ import annotations

import uuid
from typing import TYPE_CHECKING, Annotated, Self

from fastapi import Depends, Request

from gateway.accounts.keys import Principal
from gateway.quotas import Quotas
from gateway.quotas.limits import Limits

if TYPE_CHECKING:  # gateway.context imports this module: the type only
    from gateway.context import AppServices


class SamplingSlot:
    """One held slot; an async context manager that releases on exit."""

    __slots__ = ("_member", "_quotas", "_released", "who")

    def __init__(self, quotas: Quotas, who: Principal, member: str) -> None:
        self._quotas, self.who, self._member = quotas, who, member
        self._released = False

    async def release(self) -> None:
        if not self._released:
            self._released = True
            await self._quotas.release_sample_slot(self.who, self._member)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.release()


class _Acquire:
    """``await limiter.acquire(who)`` → slot; ``async with limiter.acquire(who):`` → held."""

    def __init__(self, limiter: SamplingLimiter, who: Principal, limits: Limits | None) -> None:
        self._limiter, self._who, self._limits = limiter, who, limits
        self._slot: SamplingSlot | None = None

    async def _take(self) -> SamplingSlot:
        member = uuid.uuid4().hex
        quotas = self._limiter.quotas
        limits = self._limits if self._limits is not None else quotas.limits(self._who)
        await quotas.acquire_sample_slot(self._who, member, limits)
        return SamplingSlot(self._limiter.quotas, self._who, member)

    def __await__(self):
        return self._take().__await__()

    async def __aenter__(self) -> SamplingSlot:
        self._slot = await self._take()
        return self._slot

    async def __aexit__(self, *exc: object) -> None:
        if self._slot is not None:
            await self._slot.release()


class SamplingLimiter:
    def __init__(self, quotas: Quotas) -> None:
        self.quotas = quotas

    def acquire(self, who: Principal, limits: Limits | None = None) -> _Acquire:
        """Take a slot now, or raise `RateLimitedError` when the user (or org) is at its limit.
        Pass ``limits`` when the caller already read them with its own DB session."""
        return _Acquire(self, who, limits)


async def get_sampling_limiter(request: Request) -> SamplingLimiter:
    services: AppServices = request.app.state.services
    return SamplingLimiter(services.quotas)


SamplingLimiterDep = Annotated[SamplingLimiter, Depends(get_sampling_limiter)]
