"""Validation of one `SampleInput` against a sampling backend's limits, shared by the backends.

Owns the rules and the client-facing messages (each names the offending field) for prompts,
``num_samples`` and `SamplingParams`. The torch sampler and the vLLM backend both use this
function, so both reject the same inputs with the same words; the logprob extras (top-k,
alternatives, targets, last_n) only the torch sampler computes.
"""

from __future__ import annotations

import math
import numbers

import numpy as np

from engine.errors import UserInputError
from engine.protocol import SEED_RANGE, SampleInput, SamplingParams


def is_int(v) -> bool:
    """An integer (numpy integers count), not a bool."""
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


#: widest top-k logprobs matrix per position we return (Tinker bounds it too; 20 is OpenAI's);
#: also the bound of prompt_alt_tokens_k
MAX_TOPK = 20
#: token ids scored per prompt position with target_prompt_logprobs
MAX_TARGET_IDS = 64

_EXTRAS = ("topk_prompt_logprobs", "topk_sample_logprobs", "prompt_alt_tokens_k")


def validate_sample_input(
    inp: SampleInput, *, vocab_size: int, max_positions: int, logprob_extras: bool = False
) -> None:
    """Raise `UserInputError` naming the field when ``inp`` cannot be sampled.

    ``max_positions`` bounds prompt length + max_tokens (the model's or the engine's context).
    ``logprob_extras``: whether the backend computes top-k logprobs, prompt alternatives, target
    logprobs and prompt_logprobs_last_n; a backend that does not rejects asking for them.
    """
    p: SamplingParams = inp.params
    prompt = inp.prompt_tokens
    if not prompt:
        raise UserInputError("prompt: must contain at least one token")
    for j, t in enumerate(prompt):
        if not is_int(t) or not 0 <= t < vocab_size:
            raise UserInputError(
                f"prompt: token id {t!r} at position {j} is out of range [0, {vocab_size}) "
                "(the vocab size)"
            )
    if not is_int(inp.num_samples) or inp.num_samples < 1:
        raise UserInputError(f"num_samples: {inp.num_samples!r} must be an integer >= 1")
    if not is_int(p.max_tokens) or p.max_tokens < 1:
        raise UserInputError(
            f"sampling_params.max_tokens: {p.max_tokens!r} must be an integer >= 1"
        )
    if len(prompt) + p.max_tokens > max_positions:
        raise UserInputError(
            f"sampling_params.max_tokens: prompt length {len(prompt)} + max_tokens {p.max_tokens} "
            f"exceeds the model's maximum sequence length {max_positions}"
        )
    if (
        not (isinstance(p.temperature, (int, float)) and math.isfinite(p.temperature))
        or p.temperature < 0
    ):
        raise UserInputError(f"sampling_params.temperature: {p.temperature!r} must be >= 0")
    if not is_int(p.top_k) or p.top_k < -1:
        raise UserInputError(f"sampling_params.top_k: {p.top_k!r} must be -1 (off) or >= 1")
    if not (isinstance(p.top_p, (int, float)) and 0 < p.top_p <= 1):
        raise UserInputError(f"sampling_params.top_p: {p.top_p!r} must be in (0, 1]")
    if p.seed is not None and not is_int(p.seed):
        raise UserInputError(f"sampling_params.seed: {p.seed!r} must be an integer")
    if p.seed is not None and not SEED_RANGE[0] <= int(p.seed) <= SEED_RANGE[1]:
        raise UserInputError(f"sampling_params.seed: {p.seed} must fit a signed 64-bit integer")
    for t in p.stop_token_ids:
        if not is_int(t) or t < 0:
            raise UserInputError(f"sampling_params.stop: token id {t!r} must be an integer >= 0")
    if any(not isinstance(s, str) or not s for s in p.stop_strings):
        raise UserInputError("sampling_params.stop: stop strings must be non-empty strings")
    if logprob_extras:
        _validate_extras(inp, vocab_size)
        return
    for name in _EXTRAS:
        if getattr(inp, name):
            raise UserInputError(f"{name}: not supported by this sampler backend; use 0")
    for name, value in (
        ("target_prompt_logprobs", inp.target_prompt_ids),
        ("prompt_logprobs_last_n", inp.prompt_logprobs_last_n),
    ):
        if value is not None:
            raise UserInputError(f"{name}: not supported by this sampler backend; leave it unset")


def _validate_extras(inp: SampleInput, vocab_size: int) -> None:
    prompt = inp.prompt_tokens
    for name in _EXTRAS:
        k = getattr(inp, name)
        if not is_int(k) or not 0 <= k <= MAX_TOPK:
            raise UserInputError(f"{name}: {k!r} must be an integer in [0, {MAX_TOPK}]")
    if inp.topk_prompt_logprobs and not inp.prompt_logprobs:
        raise UserInputError(
            "topk_prompt_logprobs: needs include_prompt_logprobs (prompt_logprobs)"
        )
    if inp.prompt_alt_tokens_k and len(prompt) < 2:
        raise UserInputError("prompt_alt_tokens_k: needs a prompt of at least 2 tokens")
    if inp.target_prompt_ids is not None:
        _validate_targets(np.asarray(inp.target_prompt_ids), len(prompt), vocab_size)
    n = inp.prompt_logprobs_last_n
    if n is not None:
        if not inp.prompt_logprobs:
            raise UserInputError(
                "prompt_logprobs_last_n: applies to prompt logprobs; set prompt_logprobs"
            )
        if not is_int(n) or not 1 <= n <= len(prompt) - 1:
            raise UserInputError(
                f"prompt_logprobs_last_n: {n!r} must be between 1 and len(prompt) - 1 = "
                f"{len(prompt) - 1}"
            )


def _validate_targets(ids: np.ndarray, prompt_len: int, vocab_size: int) -> None:
    rows = prompt_len - 1
    if ids.ndim != 2 or ids.shape[0] != rows or not 1 <= ids.shape[1] <= MAX_TARGET_IDS:
        raise UserInputError(
            f"target_prompt_logprobs: shape {list(ids.shape)} must be [len(prompt) - 1 = "
            f"{rows}, K] with 1 <= K <= {MAX_TARGET_IDS}"
        )
    if not np.issubdtype(ids.dtype, np.integer):
        raise UserInputError("target_prompt_logprobs: must hold int64 token ids")
    if ((ids < -1) | (ids >= vocab_size)).any():
        raise UserInputError(
            f"target_prompt_logprobs: token ids must be -1 (none) or in [0, {vocab_size})"
        )
    if not (ids >= 0).any():
        raise UserInputError("target_prompt_logprobs: must name at least one token id")
