"""Per-user limit on concurrent sampling requests.

Owns `SamplingLimiter` (in-process, keyed by user id) and the FastAPI dependency
`SamplingLimiterDep`, which creates the limiter lazily on ``app.state.sampling_limiter`` from
``ServerConfig.max_concurrent_samples_per_user`` (0 = no limit). A request over the limit gets
`RateLimitedError` (429 with ``retry-after``); the Tinker SDK backs off and retries the same
seq_id, OpenAI clients retry 429 too.

Usage: ``async with limiter.acquire(user_id): ...`` holds one slot for the block, or
``slot = limiter.acquire(user_id)`` … ``slot.release()`` when the work outlives the request (the
Tinker ``asample`` future). ``acquire`` takes the slot immediately (or raises); ``release`` is
idempotent. Every call happens on the gateway's event loop, so no lock is needed.
"""

from __future__ import annotations

from typing import Annotated, Self

from fastapi import Depends, Request

from gateway.errors import RateLimitedError

#: seconds a client is told to wait before retrying (the ``retry-after`` header)
RETRY_AFTER_S = 1.0


class SamplingSlot:
    """One held slot; a sync and async context manager that releases on exit."""

    __slots__ = ("_limiter", "_released", "user_id")

    def __init__(self, limiter: SamplingLimiter, user_id: int) -> None:
        self._limiter = limiter
        self.user_id = user_id
        self._released = False

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._limiter._release(self.user_id)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.release()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class SamplingLimiter:
    """At most ``max_per_user`` slots held at once per user id (``max_per_user`` 0: unlimited)."""

    def __init__(self, max_per_user: int, retry_after_s: float = RETRY_AFTER_S) -> None:
        if max_per_user < 0:
            raise ValueError(f"max_per_user must be >= 0, got {max_per_user}")
        self.max_per_user = max_per_user
        self.retry_after_s = retry_after_s
        self._in_flight: dict[int, int] = {}

    def in_flight(self, user_id: int) -> int:
        return self._in_flight.get(user_id, 0)

    def acquire(self, user_id: int) -> SamplingSlot:
        """Take a slot now, or raise `RateLimitedError` when the user already holds the maximum."""
        held = self._in_flight.get(user_id, 0)
        if self.max_per_user and held >= self.max_per_user:
            raise RateLimitedError(
                f"too many concurrent sampling requests: {held} in flight, the limit is "
                f"{self.max_per_user} per user (max_concurrent_samples_per_user); retry later",
                self.retry_after_s,
            )
        self._in_flight[user_id] = held + 1
        return SamplingSlot(self, user_id)

    def _release(self, user_id: int) -> None:
        held = self._in_flight.get(user_id, 0) - 1
        if held > 0:
            self._in_flight[user_id] = held
        else:
            self._in_flight.pop(user_id, None)


async def get_sampling_limiter(request: Request) -> SamplingLimiter:
    """The app's limiter, created on first use (async: runs on the event loop, so no race)."""
    state = request.app.state
    limiter = getattr(state, "sampling_limiter", None)
    if limiter is None:
        config = state.server_config
        limiter = SamplingLimiter(int(getattr(config, "max_concurrent_samples_per_user", 64)))
        state.sampling_limiter = limiter
    return limiter


SamplingLimiterDep = Annotated[SamplingLimiter, Depends(get_sampling_limiter)]
