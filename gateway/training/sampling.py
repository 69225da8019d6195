"""Sampling parameters from a dialect's wire fields: one function, the EOS rule named.

Owns `sampling_params` and `EosRule`. The dialects differ in what ends a sequence at the
end-of-sequence token, and each difference is kept on purpose (public behaviour of each API):

* ``"unless_stop"`` (Tinker): the SDK's ``stop`` (strings or token ids) replaces EOS; with no
  ``stop`` a sequence ends at EOS. An RL loop passes its renderer's stop tokens and gets those
  and nothing else, so its rollouts end exactly where its renderer says a turn ends.
* ``"always"`` (OpenAI): a completion always ends at EOS; ``stop`` only adds strings, as in
  OpenAI's API.
* ``"unless_empty_stop"`` (upstream Twinkle's native sampler): EOS ends a sequence, with or
  without ``stop``; only an explicitly empty ``stop`` (``[]`` or ``""``) generates through EOS
  up to ``max_tokens``. Upstream's cookbook passes stop strings *and* relies on EOS.
"""

from __future__ import annotations

from typing import Literal

from engine.protocol import SamplingParams

EosRule = Literal["unless_stop", "always", "unless_empty_stop"]


def stops_at_eos(stop: str | list[str] | list[int] | None, rule: EosRule) -> bool:
    if rule == "always":
        return True
    if rule == "unless_stop":
        return stop is None
    return stop is None or bool(stop)


def sampling_params(
    *,
    stop: str | list[str] | list[int] | None,
    eos: EosRule,
    max_tokens: int,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = -1,
    seed: int | None = None,
) -> SamplingParams:
    """``stop`` as the wire gives it: one string, strings, or token ids."""
    strings: list[str] = []
    token_ids: list[int] = []
    if isinstance(stop, str):
        strings = [stop]
    elif isinstance(stop, list) and stop and isinstance(stop[0], int):
        token_ids = [int(t) for t in stop]
    elif isinstance(stop, list):
        strings = [str(s) for s in stop]
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        seed=seed,
        stop_strings=strings,
        stop_token_ids=token_ids,
        stop_at_eos=stops_at_eos(stop, eos),
    )
