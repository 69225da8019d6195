"""Metering: training tokens, and the admission of one sampling request.

Owns `charge_training` / `record_training` (the training-token rate before a pass, the ledger
row after it), `check_sample_size` (the per-request caps of a sampling request, every dialect),
`SampleAdmission` and `admitted`: one sampling request's concurrent-sampling slot, its
sample-token charge and its ledger rows, given back exactly once whether the request
succeeds, fails, streams or outlives the HTTP request (a Tinker future).

Every ledger row carries the client session the work belongs to, so billing and
``get_billing_usage`` can attribute it; where a request is bound to no session (an OpenAI call on
a base model, a Tinker ``asample`` without a sampling session), the row says so with no session.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from gateway.accounts.keys import Principal
from gateway.accounts.usage import UsageLedger
from gateway.config import GatewayConfig
from gateway.context import RequestContext
from gateway.errors import PayloadTooLargeError
from gateway.quotas import Quotas
from gateway.quotas.concurrency import SamplingLimiter, SamplingSlot
from gateway.quotas.limits import Limits
from gateway.quotas.store import RateCheck


async def charge_training(ctx: RequestContext, n_tokens: int) -> None:
    """Charge the training-token rate: 429 + retry-after over it, 403 if it can never fit."""
    await ctx.quotas.charge_tokens(ctx.who, "train", n_tokens, ctx.quotas.limits(ctx.who, ctx.db))


def record_training(
    usage: UsageLedger, who: Principal, session_id: str, base_model: str, n_tokens: int
) -> None:
    """The ledger row of a pass that ran (after it ran: a refused pass is not billed)."""
    usage.record(
        user_id=who.user_id,
        org_id=who.org_id,
        kind="training",
        quantity=n_tokens,
        session_id=session_id,
        base_model=base_model,
    )


def check_sample_size(
    caps: GatewayConfig, field: str, sequences: int, tokens: int | None = None
) -> None:
    """413 for a sampling request over the per-request caps: its sequences (``field`` names
    their count) and, when known, its tokens (prompts + sequences x max_tokens). The
    concurrent-sampling limit counts requests, so without these one request could hold a slot
    for 256 inputs x 64 samples x 8,192 tokens."""
    if sequences > caps.max_sequences_per_sample_request:
        raise PayloadTooLargeError(
            f"{field}: {sequences} sequences in one request, over this server's limit of "
            f"{caps.max_sequences_per_sample_request} (gateway.max_sequences_per_sample_request); "
            "split the request"
        )
    if tokens is not None and tokens > caps.max_sample_tokens_per_request:
        raise PayloadTooLargeError(
            f"max_tokens: prompts + sequences x max_tokens come to {tokens} tokens, over this "
            f"server's limit of {caps.max_sample_tokens_per_request} per request "
            "(gateway.max_sample_tokens_per_request); lower max_tokens or split the request"
        )


class SampleAdmission:
    """One admitted sampling request: its slot and, once the prompt is known (`meter`), its
    token charge. `finish` (once; later calls do nothing) refunds the unused budget, writes the
    prefill and sampled tokens to the ledger and frees the slot."""

    def __init__(
        self,
        quotas: Quotas,
        usage: UsageLedger,
        who: Principal,
        limits: Limits,
        slot: SamplingSlot,
        session_id: str | None,
        caps: GatewayConfig,
    ) -> None:
        self._quotas, self._usage, self._who, self._limits = quotas, usage, who, limits
        self._caps = caps
        self._slot, self._session_id = slot, session_id
        self._charged: list[RateCheck] = []
        self._base_model, self._prompt, self._budget = "", 0, 0
        self._finished = False

    async def meter(
        self,
        base_model: str,
        prompt_tokens: int,
        max_new_tokens: int,
        sequences: int = 1,
        field: str = "num_samples",
    ) -> None:
        """Charge prompt + the most it may generate now (429 + retry-after over the rate); a
        request over the per-request caps is a 413 first (``field`` names its sequence count)."""
        budget = prompt_tokens + max_new_tokens
        check_sample_size(self._caps, field, sequences, budget)
        self._charged = await self._quotas.charge_tokens(self._who, "sample", budget, self._limits)
        self._base_model, self._prompt, self._budget = base_model, prompt_tokens, budget

    async def finish(self, sampled: int | None) -> None:
        """``sampled`` tokens were generated (None: the request failed or the client left)."""
        if self._finished:
            return
        self._finished = True
        try:
            if self._charged:
                used = 0 if sampled is None else self._prompt + sampled
                await self._quotas.refund_tokens(self._charged, self._budget - used)
            if self._budget and sampled is not None:
                for kind, n in (("sampling_prefill", self._prompt), ("sampling_sample", sampled)):
                    self._usage.record(
                        user_id=self._who.user_id,
                        org_id=self._who.org_id,
                        kind=kind,
                        quantity=n,
                        session_id=self._session_id,
                        base_model=self._base_model,
                    )
        finally:
            await self._slot.release()


@asynccontextmanager
async def admitted(ctx: RequestContext, session_id: str | None) -> AsyncIterator[SampleAdmission]:
    """Hold a slot of the caller's concurrent-sampling limit (429 when none is free). If the
    block raises, everything is given back; otherwise the admission stays open for whoever owns
    the result (the handler, its stream, or a future) to `finish`."""
    limits = ctx.quotas.limits(ctx.who, ctx.db)
    slot = await SamplingLimiter(ctx.quotas).acquire(ctx.who, limits)
    adm = SampleAdmission(
        ctx.quotas, ctx.usage, ctx.who, limits, slot, session_id, ctx.config.gateway
    )
    try:
        yield adm
    except BaseException:
        await adm.finish(None)
        raise
