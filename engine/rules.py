"""The rules both sides of the engine seam apply, so the gateway needs nothing heavier than this
module (no torch) to apply them before the engine does.

Owns: the LoRA target groups and how a peft-style LoRA config maps onto a `LoraSpec` (the gateway
meters and records the spec before the Trainer builds the adapter); the loss names the engine
treats specially (embedding losses, the loss that reads recorded stability info, the custom loss
and its graph bounds);
how native-API models and their adapter runs are named, and what a Trainer call about a model
is routed by (the gateway routes by these names; the Trainer's native-model host,
engine/native/host.py, uses them). The types these rules speak about are in `engine.protocol`.
"""

from __future__ import annotations

import math
import re
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

from engine.errors import UserInputError
from engine.protocol import DEFAULT_LORA_ALPHA, SEED_RANGE, LoraSpec

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
    vision = _get(config, "train_vision", default=False)
    if not isinstance(vision, bool):
        raise UserInputError(f"lora config: train_vision {vision!r} must be true or false")
    flags, vision = _target_flags(_get(config, "target_modules"), vision)
    _check_numbers(rank, alpha, seed)
    return LoraSpec(
        rank=int(rank), alpha=float(alpha), seed=int(seed), train_vision=vision, **flags
    )


def _target_flags(targets: Any, vision: bool) -> tuple[dict[str, bool], bool]:
    """LoraSpec's group flags and its ``train_vision`` for a config's ``target_modules``."""
    flags = dict.fromkeys([name for name, _ in _GROUPS], True)
    if isinstance(targets, str):
        if targets == "all-linear":
            flags["train_unembed"] = False
        elif targets != "all":
            raise UserInputError(
                f"lora config: target_modules {targets!r} is not supported; use 'all-linear', "
                "'all' or a list of module names"
            )
        return flags, vision
    if targets is None:
        return flags, vision
    names = {str(t).rsplit(".", 1)[-1] for t in targets}
    tower = names & set(VISION_TARGETS)
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
        # 4: past this helper and lora_spec_from_config, to the code that built the config
        warnings.warn(
            f"lora config: target_modules name part of a module group; also training {added}",
            stacklevel=4,
        )
    return flags, vision or bool(tower)


def _check_numbers(rank: Any, alpha: Any, seed: Any) -> None:
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


def spec_target_modules(spec: LoraSpec) -> list[str]:
    """The module names ``spec`` trains."""
    names = [m for flag, group in _GROUPS if getattr(spec, flag) for m in group]
    return names + list(VISION_TARGETS) if spec.train_vision else names


# -- loss names ------------------------------------------------------------------------------------

#: losses over pooled sentence embeddings instead of token log-probs (upstream Twinkle's
#: ``InfonceLoss`` with ``task='embedding'``): reached only through the native API, never through
#: Tinker's routes; a request of one is never sliced (the loss couples all of its rows).
EMBEDDING_LOSS_FNS = ("infonce",)

#: the loss that reads what the sampler recorded (``record_stability_info``): the gateway resolves
#: a datum's provenance spans into these two ``loss_fn_inputs`` before the engine sees it, so the
#: engine needs no access to the records: per target position, the sampler's own logprob of the
#: sampled token (0 elsewhere) and 1 where the position is a sampled token (0 elsewhere). Any
#: values a client sends under these names are replaced.
STABLE_REINFORCE = "stable_reinforce"
RECORDED_LOGPROBS, RECORDED_MASK = "recorded_logprobs", "recorded_mask"

#: the loss name of a server-side custom loss (Tinker's ``loss_fn="custom"``)
CUSTOM_LOSS_FN = "custom"

_POLICY = frozenset({"target_tokens", "logprobs", "advantages"})
#: the ``loss_fn_inputs`` each built-in loss reads (engine/backends/losses.py ``LOSSES``: its
#: inputs and optional inputs, plus the targets every token loss reads; ``importance_sampling``
#: also reads what ``dpo`` does, ``ref_logps`` for its ``ref_logprobs``, under upstream's DPO
#: convention, engine/backends/tinker_dpo.py).
#: Anything else in a request is dropped unread: decoding it would only cost memory.
LOSS_FN_INPUTS: dict[str, frozenset[str]] = {
    "cross_entropy": frozenset({"target_tokens", "weights"}),
    "importance_sampling": _POLICY | {"ref_logps", "weights"},
    "ppo": _POLICY,
    "cispo": _POLICY,
    "dro": _POLICY,
    "gspo": _POLICY | {"sequence_ratio_mask"},
    STABLE_REINFORCE: frozenset({"target_tokens", "advantages", RECORDED_LOGPROBS, RECORDED_MASK}),
    "dpo": frozenset({"target_tokens", "weights", "ref_logprobs"}),
    "infonce": frozenset({"anchor"}),
}


def loss_fn_input_names(
    loss_fn: str, custom_inputs: Sequence[Sequence[Any]] | None = None
) -> frozenset[str]:
    """The ``loss_fn_inputs`` names ``loss_fn`` reads. A custom loss reads ``target_tokens`` and
    the inputs its graph declares after ``logprobs`` (``custom_inputs``: its ``(name, rank)``
    pairs); an unknown loss reads nothing (the engine refuses it by name)."""
    if loss_fn == CUSTOM_LOSS_FN:
        return frozenset({"target_tokens", *(str(n) for n, _ in list(custom_inputs or ())[1:])})
    return LOSS_FN_INPUTS.get(loss_fn, frozenset())


#: a custom loss graph's bounds: nodes, and nesting of a node's arguments (the gateway refuses
#: larger uploads before they travel; engine/backends/custom_loss_graph.py checks everything else)
CUSTOM_LOSS_MAX_NODES = 2048
CUSTOM_LOSS_MAX_ARG_DEPTH = 8


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
_NATIVE_RUN = re.compile(r"(.+:tw-[0-9a-f]{8}):[A-Za-z0-9][A-Za-z0-9._-]*")  # fullmatch


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
    m = _NATIVE_RUN.fullmatch(model_id)
    return m.group(1) if m else model_id
