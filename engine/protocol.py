"""Internal types exchanged between the gateway and the engine (and engine ↔ backends).

These are neither wire schemas (the gateway owns those) nor DB rows. Plain dataclasses, so they
pickle cheaply across Ray processes. Array fields hold numpy arrays; shapes are in the names' docs.

Also the few rules both sides apply, so that the gateway needs nothing heavier than this module
(no torch): the LoRA target groups and how a peft-style LoRA config maps onto a `LoraSpec` (the
gateway meters and records the spec before the Trainer builds the adapter), and how native-API
models and their adapter runs are named (the gateway routes by these names; the Trainer's
native-model host, engine/native/host.py, uses them).
"""

from __future__ import annotations

import math
import re
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from engine.errors import UserInputError

#: Tinker's documented AdamParams defaults (tinker/types/optim_step_request.py).
DEFAULT_LR = 1e-4
#: LoRA alpha used when the client does not choose one (Tinker's wire format has no alpha field).
DEFAULT_LORA_ALPHA = 32.0
#: the seeds a LoRA init (and a sampler) takes: signed 64-bit (inside torch generators' range)
SEED_RANGE = (-(2**63), 2**63 - 1)


@dataclass(frozen=True)
class LoraSpec:
    """Configuration of one adapter. Target modules follow Tinker's three switches:
    train_attn → q/k/v/o projections, train_mlp → gate/up/down projections,
    train_unembed → lm_head; plus ``train_vision`` (off by default, vision-language models only):
    the vision tower's block projections too (VISION_TARGETS)."""

    rank: int
    alpha: float = DEFAULT_LORA_ALPHA
    train_attn: bool = True
    train_mlp: bool = True
    train_unembed: bool = True
    seed: int = 0
    train_vision: bool = False


# -- LoRA targets and configs ------------------------------------------------------------------

#: the module groups an adapter trains, switched by LoraSpec's three flags (engine/backends/lora.py)
ATTN_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_TARGETS = ("gate_proj", "up_proj", "down_proj")
UNEMBED_TARGETS = ("lm_head",)
#: a VL model's vision-tower block projections (Qwen2-VL / Qwen2.5-VL: attn.qkv, attn.proj,
#: mlp.fc1/fc2); trained only with ``train_vision`` (engine/backends/lora.py finds the tower's
#: layers by position, so a tower MLP named gate/up/down_proj follows this switch, not train_mlp)
VISION_TARGETS = ("qkv", "proj", "fc1", "fc2")
_GROUPS = (
    ("train_attn", ATTN_TARGETS),
    ("train_mlp", MLP_TARGETS),
    ("train_unembed", UNEMBED_TARGETS),
)
_UNSUPPORTED_LORA = {
    "use_dora": lambda v: bool(v),
    "use_rslora": lambda v: bool(v),
    "bias": lambda v: v not in (None, "none"),
    "modules_to_save": lambda v: bool(v),
    "rank_pattern": lambda v: bool(v),
    "alpha_pattern": lambda v: bool(v),
}


def _get(config: Any, *names: str, default: Any = None) -> Any:
    for n in names:
        if isinstance(config, Mapping):
            if config.get(n) is not None:
                return config[n]
        elif getattr(config, n, None) is not None:
            return getattr(config, n)
    return default


def lora_spec_from_config(config: Any) -> LoraSpec:
    """A peft ``LoraConfig`` (duck-typed) or dict as a LoraSpec.

    ``r``/``rank`` is required; ``lora_alpha``/``alpha`` defaults to 32 (the server's default);
    ``seed`` to 0. ``target_modules``: absent/None or "all" → attention + MLP + lm_head (Tinker's
    default); "all-linear" → attention + MLP (PEFT leaves the output layer out); a list → the
    groups it names. Naming part of a group (e.g. PEFT's common ``["q_proj", "v_proj"]``) trains
    the whole group, with a warning: adapters switch q/k/v/o, gate/up/down and lm_head as groups.
    ``lora_dropout`` is ignored (training runs without dropout, so it is reproducible).
    The vision tower of a VL model is opt-in: ``train_vision: True`` or naming its modules
    (VISION_TARGETS) in the list; "all-linear" keeps to the language model.
    """
    bad = [k for k, rule in _UNSUPPORTED_LORA.items() if rule(_get(config, k))]
    if bad:
        raise UserInputError(f"lora config: unsupported option(s) {', '.join(bad)}")
    rank = _get(config, "r", "rank")
    if rank is None:
        raise UserInputError("lora config: 'r' (rank) is required")
    alpha = _get(config, "lora_alpha", "alpha", default=DEFAULT_LORA_ALPHA)
    seed = _get(config, "seed", default=0)
    targets = _get(config, "target_modules")
    flags = dict.fromkeys([name for name, _ in _GROUPS], True)
    vision = _get(config, "train_vision", default=False)
    if not isinstance(vision, bool):
        raise UserInputError(f"lora config: train_vision {vision!r} must be true or false")
    if isinstance(targets, str):
        if targets == "all-linear":
            flags["train_unembed"] = False
        elif targets != "all":
            raise UserInputError(
                f"lora config: target_modules {targets!r} is not supported; use 'all-linear', "
                "'all' or a list of module names"
            )
    elif targets is not None:
        names = {str(t).rsplit(".", 1)[-1] for t in targets}
        tower = names & set(VISION_TARGETS)
        vision = vision or bool(tower)
        names -= tower
        known = {m for _, group in _GROUPS for m in group}
        unknown = sorted(names - known)
        if unknown:
            raise UserInputError(
                f"lora config: target_modules {unknown} cannot be targeted; targetable modules: "
                f"{', '.join(m for _, g in _GROUPS for m in g)} (and a VL model's vision tower: "
                f"{', '.join(VISION_TARGETS)})"
            )
        added = sorted(set(VISION_TARGETS) - tower) if tower else []
        for flag, group in _GROUPS:
            chosen = names & set(group)
            flags[flag] = bool(chosen)
            if chosen and chosen != set(group):
                added += sorted(set(group) - chosen)
        if added:
            warnings.warn(
                f"lora config: target_modules name part of a module group; also training {added}",
                stacklevel=3,
            )
    for name, value in (("r", rank), ("lora_alpha", alpha), ("seed", seed)):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise UserInputError(f"lora config: {name} {value!r} must be a number")
        if not math.isfinite(value):  # int(inf) is an OverflowError; JSON may carry Infinity
            raise UserInputError(f"lora config: {name} {value!r} must be finite")
    if rank != int(rank) or seed != int(seed):
        raise UserInputError("lora config: r and seed must be integers")
    if not SEED_RANGE[0] <= int(seed) <= SEED_RANGE[1]:
        # torch's generators and the gateway's 64-bit seed column take no more
        raise UserInputError(f"lora config: seed {int(seed)} must fit a signed 64-bit integer")
    return LoraSpec(
        rank=int(rank), alpha=float(alpha), seed=int(seed), train_vision=vision, **flags
    )


def spec_target_modules(spec: LoraSpec) -> list[str]:
    """The module names ``spec`` trains."""
    names = [m for flag, group in _GROUPS if getattr(spec, flag) for m in group]
    return names + list(VISION_TARGETS) if spec.train_vision else names


@dataclass(frozen=True)
class ImagePart:
    """One image of a model input (a Tinker ``ImageChunk``): its encoded bytes, declared format
    (png | jpeg), the index into the text ``tokens`` where its image tokens go, the client's
    ``expected_tokens`` (None: not given) and the chunk's index in the client's chunk list (for
    error messages). The engine decodes and expands it (engine/backends/vision.py)."""

    data: bytes
    format: str
    position: int
    expected_tokens: int | None = None
    chunk_index: int = 0


@dataclass
class DatumInput:
    """One training example. ``tokens`` is the model input (length N). ``loss_fn_inputs`` maps names
    to arrays whose first dimension is N: ``target_tokens`` int64 [N] (or [N, K]), ``weights``
    float32 [N] (or [N, K]), and, for RL losses, ``logprobs`` / ``advantages`` float32 [N].
    Embedding losses (`EMBEDDING_LOSS_FNS`) take no targets: ``anchor`` float32 [1] (1 = this row
    is an anchor and starts a group, 0 = the positive / a negative of the current group).

    With ``images`` (VL models), ``tokens`` holds only the text tokens and N counts each image's
    tokens too (as Tinker's ``ModelInput.length`` does). Upstream Twinkle sends images already
    expanded into ``tokens`` with ``pixel_values`` / ``image_grid_thw`` in ``loss_fn_inputs``."""

    tokens: list[int]
    loss_fn_inputs: dict[str, np.ndarray]
    images: list[ImagePart] = field(default_factory=list)


#: losses over pooled sentence embeddings instead of token log-probs (upstream Twinkle's
#: ``InfonceLoss`` with ``task='embedding'``): reached only through the native API, never through
#: Tinker's routes; a request of one is never sliced (the loss couples all of its rows).
EMBEDDING_LOSS_FNS = ("infonce",)

#: Tinker loss names we refuse (a 400 at submission, naming ``loss_fn``), with what to do instead
REFUSED_LOSS_FNS = {
    "stable_reinforce": (
        "Tinker has not published this loss's objective (it reads stability info that its "
        "sampler records, in an undocumented form), so no other server can compute the same "
        "loss; train with 'ppo' (clipped, stable on off-policy data), 'cispo' or 'gspo' "
        "instead (tinker-cookbook: loss_fn=ppo)"
    ),
}


#: the loss name of a server-side custom loss (Tinker's ``loss_fn="custom"``)
CUSTOM_LOSS_FN = "custom"
#: a custom loss graph's bounds: nodes, and nesting of a node's arguments (the gateway refuses
#: larger uploads before they travel; engine/backends/custom_loss_graph.py checks everything else)
CUSTOM_LOSS_MAX_NODES = 2048
CUSTOM_LOSS_MAX_ARG_DEPTH = 8


@dataclass(frozen=True)
class CustomLossGraph:
    """A traced custom loss as the Tinker SDK uploads it (``create_custom_loss``): ``inputs`` are
    (name, rank) pairs, ``logprobs`` first; ``nodes`` the torch.fx nodes as plain JSON data
    (``{"op", "name", "target", "args", "kwargs"}``). Checked and run by
    engine/backends/custom_loss_graph.py; the gateway stores it per session."""

    name: str
    inputs: tuple[tuple[str, int], ...]
    nodes: tuple[dict[str, Any], ...]


@dataclass
class ForwardBackwardInput:
    data: list[DatumInput]
    loss_fn: str = "cross_entropy"
    loss_fn_config: dict[str, float | str] = field(default_factory=dict)
    forward_only: bool = False
    #: the graph of ``loss_fn == CUSTOM_LOSS_FN`` (the gateway attaches it by ``loss_id``)
    custom_loss: CustomLossGraph | None = None


@dataclass
class ForwardBackwardOutput:
    """``outputs[i]`` belongs to ``data[i]``: ``logprobs`` float32 [N] (learner log p of targets),
    ``elementwise_loss`` float32 [N] where the loss is per token (not DPO); for an embedding loss
    ``embedding`` float32 [H] (the pooled, L2-normalised sentence embedding) instead. ``metrics``
    keys are ``name:reduction`` (always ``loss:sum``)."""

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
    #: images of the prompt (VL models; positions index ``prompt_tokens``, text tokens only)
    prompt_images: list[ImagePart] = field(default_factory=list)
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


# -- native Twinkle API models (engine/native/host.py) ------------------------------------------

#: methods of `engine.local.model.MultiLoraTransformersModel` a native model serves remotely, by
#: name (``POST /api/v1/model/<base>/twinkle/{method}``); any other name is refused before any work
NATIVE_MODEL_METHODS = frozenset(
    {
        "add_adapter_to_model",
        "add_metric",
        "remove_adapter",
        "set_template",
        "set_processor",
        "set_loss",
        "set_optimizer",
        "set_lr_scheduler",
        "get_train_configs",
        "forward",
        "forward_only",
        "forward_backward",
        "calculate_loss",
        "backward",
        "clip_grad_norm",
        "step",
        "zero_grad",
        "lr_step",
        "clip_grad_and_step",
        "calculate_metric",
        "save",
        "load",
        "resume_from_checkpoint",
    }
)
#: a native model id is ``{session_id}:tw-{8 hex digits}``; its adapter ``a`` trains as the run
#: ``{model_id}:a`` (adapter names match ``[A-Za-z0-9][A-Za-z0-9._-]*``, no ``:``)
_NATIVE_RUN = re.compile(r"^(.+:tw-[0-9a-f]{8}):[A-Za-z0-9][A-Za-z0-9._-]*$")


def native_model_id(session_id: str, token: str) -> str:
    """The id of a new native model in ``session_id``; ``token`` is 8 random hex digits."""
    return f"{session_id}:tw-{token}"


def native_run_id(model_id: str, adapter_name: str) -> str:
    """The training run (and Trainer adapter id) of one adapter of a native model."""
    return f"{model_id}:{adapter_name}"


def trainer_route_key(model_id: str) -> str:
    """What a Trainer call about ``model_id`` is routed by: the id itself, except that a native
    model's adapter run routes with its native model, whose Trainer replica holds all of that
    model's adapters (e.g. when session expiry releases the run by its id)."""
    m = _NATIVE_RUN.match(model_id)
    return m.group(1) if m else model_id
