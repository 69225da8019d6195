"""Metering of one synchronous sampling call (the OpenAI-compatible routes): charge the sample
token rate for prompt + the most it may generate up front, then refund what was not generated
and write the prefill / sampled tokens to the usage ledger. (The Tinker ``asample`` route does the
same around its future.)"""

from __future__ import annotations

from dataclasses import dataclass

from gateway.accounts.keys import Principal
from gateway.accounts.usage import UsageLedger
from gateway.quotas import Quotas
from gateway.quotas.limits import Limits
from gateway.quotas.store import RateCheck


@dataclass
class SampleMeter:
    quotas: Quotas
    ledger: UsageLedger
    who: Principal
    base_model: str
    prompt_tokens: int
    budget: int
    charged: list[RateCheck]

    @classmethod
    async def start(
        cls,
        state,
        who: Principal,
        limits: Limits,
        base_model: str,
        prompt_tokens: int,
        max_new_tokens: int,
    ) -> SampleMeter:
        """Charge now (429 + retry-after over the rate; 403 if it can never fit)."""
        budget = prompt_tokens + max_new_tokens
        charged = await state.quotas.charge_tokens(who, "sample", budget, limits)
        return cls(state.quotas, state.usage, who, base_model, prompt_tokens, budget, charged)

    async def finish(self, sampled: int | None) -> None:
        """``sampled`` tokens were generated (None: the call failed, refund everything)."""
        used = 0 if sampled is None else self.prompt_tokens + sampled
        await self.quotas.refund_tokens(self.charged, self.budget - used)
        if sampled is None:
            return
        for kind, n in (("sampling_prefill", self.prompt_tokens), ("sampling_sample", sampled)):
            self.ledger.record(
                user_id=self.who.user_id,
                org_id=self.who.org_id,
                kind=kind,
                quantity=n,
                base_model=self.base_model,
            )
