"""Internal types exchanged between the gateway and the engine (and engine ↔ backends).

These are neither wire schemas (the gateway owns those) nor DB rows. Plain dataclasses, so they
pickle cheaply across Ray processes. Array fields hold numpy arrays; shapes are in the names' docs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import numpy as np

#: Tinker's documented AdamParams defaults (tinker/types/optim_step_request.py).
DEFAULT_LR = 1e-4
#: LoRA alpha used when the client does not choose one (Tinker's wire format has no alpha field).
DEFAULT_LORA_ALPHA = 32.0


@dataclass(frozen=True)
class LoraSpec:
    """Configuration of one adapter. Target modules follow Tinker's three switches:
    train_attn → q/k/v/o projections, train_mlp → gate/up/down projections,
    train_unembed → lm_head."""

    rank: int
    alpha: float = DEFAULT_LORA_ALPHA
    train_attn: bool = True
    train_mlp: bool = True
    train_unembed: bool = True
    seed: int = 0


@dataclass
class DatumInput:
    """One training example. ``tokens`` is the model input (length N). ``loss_fn_inputs`` maps names
    to arrays whose first dimension is N: ``target_tokens`` int64 [N] (or [N, K]), ``weights``
    float32 [N] (or [N, K]), and, for RL losses, ``logprobs`` / ``advantages`` float32 [N]."""

    tokens: list[int]
    loss_fn_inputs: dict[str, np.ndarray]


@dataclass
class ForwardBackwardInput:
    data: list[DatumInput]
    loss_fn: str = "cross_entropy"
    loss_fn_config: dict[str, float | str] = field(default_factory=dict)
    forward_only: bool = False


@dataclass
class ForwardBackwardOutput:
    """``outputs[i]`` belongs to ``data[i]``: ``logprobs`` float32 [N] (learner log p of targets),
    ``elementwise_loss`` float32 [N] where the loss is per token (not DPO). ``metrics`` keys are
    ``name:reduction`` (always ``loss:sum``)."""

    outputs: list[dict[str, np.ndarray]]
    metrics: dict[str, float]


@dataclass
class AdamParams:
    """All fields are honoured. ``grad_clip_norm`` 0 disables clipping; weight decay is
    decoupled."""

    learning_rate: float = DEFAULT_LR
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0


@dataclass
class OptimStepOutput:
    metrics: dict[str, float]


@dataclass
class SamplingParams:
    """``temperature`` 0 means greedy. ``top_k`` -1 and ``top_p`` 1 mean off. ``stop_strings`` and
    ``stop_token_ids`` end a sequence (the stop text/token is kept in the output, as Tinker does for
    token ids). ``stop_at_eos`` is False only when the client sent an explicit empty stop list."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop_strings: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    stop_at_eos: bool = True


@dataclass
class SampleInput:
    """``adapter_dir`` is a checkpoint directory (PEFT files) or None for the base model."""

    prompt_tokens: list[int]
    num_samples: int = 1
    params: SamplingParams = field(default_factory=SamplingParams)
    prompt_logprobs: bool = False
    #: top-k most likely tokens with logprobs at every prompt position / every sampled position
    topk_prompt_logprobs: int = 0
    adapter_dir: str | None = None
    topk_sample_logprobs: int = 0
    #: score only the last N prompt tokens (earlier prompt logprobs are NaN, top-k rows empty)
    prompt_logprobs_last_n: int | None = None
    #: draws per prompt position (after the first) from the next-token distribution
    prompt_alt_tokens_k: int = 0
    #: int64 [len(prompt) - 1, K]: row i names token ids to score at prompt position i + 1;
    #: -1 = none
    target_prompt_ids: np.ndarray | None = None


#: the empty cell of a top-k matrix (Tinker's sentinel: token 0 with this logprob)
TOPK_MASK_LOGPROB = -99999.0


@dataclass
class TopkLogprobs:
    """``token_ids`` int32 and ``logprobs`` float32, both ``[length, k]``, most likely first;
    empty cells are (0, `TOPK_MASK_LOGPROB`)."""

    token_ids: np.ndarray
    logprobs: np.ndarray


@dataclass
class SampledSequence:
    tokens: list[int]
    logprobs: list[float]
    stop_reason: Literal["stop", "length"]
    topk: TopkLogprobs | None = None  # one row per token, when topk_sample_logprobs > 0


@dataclass
class SampleOutput:
    """``prompt_logprobs`` has len(prompt) values, NaN at position 0 (nothing predicts it) and
    before the last ``prompt_logprobs_last_n`` tokens; ``topk_prompt`` has len(prompt) rows, the
    same rows empty."""

    sequences: list[SampledSequence]
    prompt_logprobs: list[float] | None = None
    topk_prompt: TopkLogprobs | None = None
    #: ([len(prompt) - 1, k] int64 tokens, float32 logprobs) for ``prompt_alt_tokens_k``
    prompt_alt_tokens: tuple[np.ndarray, np.ndarray] | None = None
    #: float32, the shape of ``target_prompt_ids``; 0.0 where it had -1
    target_prompt_logprobs: np.ndarray | None = None


@dataclass
class SampleDelta:
    """A piece of a streamed sample (`Sampler.sample_stream`): new tokens and their logprobs per
    sample index, or, in the last delta, ``final``: the whole output (which supersedes them)."""

    tokens: dict[int, list[int]] = field(default_factory=dict)
    logprobs: dict[int, list[float]] = field(default_factory=dict)
    final: SampleOutput | None = None
