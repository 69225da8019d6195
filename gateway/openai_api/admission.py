"""Admission of one OpenAI sampling request: a slot of the caller's concurrent-sampling limit and
the token meter, given back exactly once whether the request succeeds, fails or streams.

Owns `admitted` (an async context manager the chat and completion handlers share) and
`Admission`. Limits: `gateway.quotas.concurrency`; metering: `gateway.quotas.metering`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import Request

from gateway.openai_api import responses
from gateway.quotas.metering import SampleMeter


class Admission:
    """One admitted sampling request: its concurrent-sampling slot and, once the prompt is known,
    its token meter. `finish` (called once, by the handler or by the stream when it ends) refunds
    the unused budget, records usage and frees the slot."""

    def __init__(self, state, who, limits, slot) -> None:
        self._state, self._who, self._limits, self._slot = state, who, limits, slot
        self._meter: SampleMeter | None = None

    async def meter(self, base_model: str, prompt_tokens: int, budget: int) -> None:
        self._meter = await SampleMeter.start(
            self._state, self._who, self._limits, base_model, prompt_tokens, budget
        )

    async def finish(self, choices: list[responses.Choice] | None) -> None:
        """``choices`` None: the request failed or the client left."""
        try:
            if self._meter is not None:
                await self._meter.finish(
                    None if choices is None else sum(c.n_tokens for c in choices)
                )
        finally:
            await self._slot.release()


@asynccontextmanager
async def admitted(request: Request, who, db, limiter) -> AsyncIterator[Admission]:
    """Hold a slot of the caller's concurrent-sampling limit (429 when none is free) for the
    block; if the block fails, give the slot and the metered budget back. On success the
    admission stays open: the handler (or its stream) calls `Admission.finish`."""
    limits = limiter.quotas.limits(who, db)
    adm = Admission(request.app.state, who, limits, await limiter.acquire(who, limits))
    try:
        yield adm
    except BaseException:
        await adm.finish(None)
        raise
