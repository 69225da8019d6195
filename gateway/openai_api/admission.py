"""Admission of one OpenAI sampling request: `gateway.training.metering`'s admission (slot, token
meter, ledger rows) with OpenAI's results, the choices, as what it finishes on.

Owns `admitted` (an async context manager the chat and completion handlers share) and
`Admission`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from gateway.context import RequestContext
from gateway.training import metering, text_stream


class Admission:
    """`finish` is called once, by the handler or by the stream when it ends."""

    def __init__(self, adm: metering.SampleAdmission) -> None:
        self._adm = adm

    async def meter(self, base_model: str, prompt_tokens: int, budget: int, sequences: int) -> None:
        """``sequences``: prompts x ``n``."""
        await self._adm.meter(base_model, prompt_tokens, budget, sequences, "n")

    async def finish(self, choices: list[text_stream.Choice] | None) -> None:
        """``choices`` None: the request failed or the client left."""
        await self._adm.finish(None if choices is None else sum(c.n_tokens for c in choices))


@asynccontextmanager
async def admitted(ctx: RequestContext, session_id: str | None) -> AsyncIterator[Admission]:
    """See `gateway.training.metering.admitted`."""
    async with metering.admitted(ctx, session_id) as adm:
        yield Admission(adm)
