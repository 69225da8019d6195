"""Per-adapter training configuration for `engine.local.model.MultiLoraTransformersModel`.

Owns the translation of upstream-Twinkle style arguments into what the training backend takes:
loss names/classes → Tinker ``loss_fn`` + ``loss_fn_config``, optimizer arguments → AdamW
hyper-parameters, and the LR schedules. (LoRA configs → `LoraSpec` is
`engine.rules.lora_spec_from_config`: the torch-free gateway applies it too.)
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, cast

from engine.errors import UserInputError
from engine.protocol import DEFAULT_LR

# ----------------------------------------------------------------------------------- losses

#: normalised name (lower case, no "_"/"-") → backend loss_fn
_LOSSES = {
    "crossentropy": "cross_entropy",
    "crossentropyloss": "cross_entropy",
    "importancesampling": "importance_sampling",
    "importancesamplingloss": "importance_sampling",
    "ppo": "ppo",
    "ppoloss": "ppo",
    "grpo": "ppo",
    "grpoloss": "ppo",
    "cispo": "cispo",
    "cispoloss": "cispo",
    "dro": "dro",
    "droloss": "dro",
    "dpo": "dpo",
    "dpoloss": "dpo",
    "infonce": "infonce",
    "infonceloss": "infonce",
}
ACCEPTED_LOSS_NAMES = (
    "cross_entropy",
    "CrossEntropyLoss",
    "importance_sampling",
    "ImportanceSamplingLoss",
    "ppo",
    "PPOLoss",
    "GRPOLoss",
    "cispo",
    "CISPOLoss",
    "dro",
    "DROLoss",
    "dpo",
    "DPOLoss",
    "InfonceLoss",
)


def _norm(name: str) -> str:
    return name.lower().replace("_", "").replace("-", "")


#: upstream Twinkle names we know but cannot run yet (a clear error instead of "unknown")
_NOT_YET: dict[str, str] = {}
#: normalised upstream class names whose reduction the local model reproduces (`resolve_loss`)
UPSTREAM_MEAN_LOSSES = ("crossentropyloss", "grpoloss", "dpoloss")
#: set by resolve_loss (1.0 / 0.0): reproduce upstream's mean reduction (`engine.local.passes`)
UPSTREAM_MEAN = "upstream_mean"
#: loss_fn_config keys the local model consumes itself (never sent to the backend)
LOCAL_LOSS_KEYS = ("reference_free",)
CE_REDUCTIONS = ("mean", "sum")
DPO_LOSS_TYPES = ("sigmoid",)


def is_upstream_mean(name: str) -> bool:
    """``name`` is an upstream class whose reduction the model reproduces (`resolve_loss`)."""
    return _norm(name) in UPSTREAM_MEAN_LOSSES


def _pop_fixed(kw: dict, cls: str, key: str, allowed: Any, why: str) -> None:
    """Accept an upstream argument only at the value our loss implements."""
    if key in kw:
        value = kw.pop(key)
        if value != allowed and not (value is None and allowed is None):
            raise UserInputError(f"{cls}: {key} {value!r} is not supported ({why})")


def _flag_value(cls: str, key: str, value: Any) -> bool:
    if isinstance(value, bool) or value in (0, 1):
        return bool(value)
    raise UserInputError(f"{cls}: {key} {value!r} must be true or false")


def _loss_name(loss: Any) -> str:
    if isinstance(loss, str):
        return loss
    if isinstance(loss, type) or inspect.isfunction(loss) or inspect.ismethod(loss):
        return loss.__name__  # a custom loss function: refused unless named like ours
    return type(loss).__name__


def resolve_loss(loss: Any, kwargs: Mapping[str, Any]) -> tuple[str, str, dict[str, float | str]]:
    """(name as given, backend loss_fn, loss_fn_config) for a loss name, class or instance.

    Only names are read (an allow-list; nothing is imported or instantiated). ``GRPOLoss`` maps to
    Tinker's ``ppo`` (clipped importance-ratio surrogate): the group-relative advantages are
    computed client-side and passed as ``advantages``, the sampler's log-probs as ``logprobs`` /
    ``old_logps``. Its ``epsilon`` / ``epsilon_high`` become ``clip_low_threshold = 1 - epsilon``
    / ``clip_high_threshold = 1 + epsilon_high`` (ratio bounds); a KL term (``beta`` other than
    0) and an entropy bonus are not available and are refused. ``DPOLoss(beta, loss_type,
    reference_free, sft_weight)`` maps to ``dpo``: only ``loss_type='sigmoid'``;
    ``reference_free`` makes the reference log-probs 0 (applied by the model, not the backend).
    ``InfonceLoss(temperature=0.1, use_batch=True, hard_negatives=None)`` maps to ``infonce``
    (embedding training, ``task='embedding'``; engine/backends/losses.py): ``hard_negatives``
    only None (each group keeps its own negatives; upstream's fixed count truncates or randomly
    upsamples them), ``mask_fake_negative`` / ``include_qq`` / ``include_dd`` only False.

    Reductions: the upstream class names ``CrossEntropyLoss`` (``reduction='mean'``, the default),
    ``GRPOLoss`` and ``DPOLoss`` get ``upstream_mean`` 1 in the config: the model reproduces
    upstream's mean reductions (`engine.local.passes.upstream_scaling`). ``CrossEntropyLoss(
    reduction='sum')`` and the Tinker names (``cross_entropy``, ``ppo``, ``dpo``, ...; also
    ``PPOLoss``, ``grpo``) keep Tinker's sums.
    """
    name = _loss_name(loss)
    norm = _norm(name)
    if norm in _NOT_YET:
        raise UserInputError(f"loss {name!r}: {_NOT_YET[norm]} is not supported yet")
    loss_fn = _LOSSES.get(norm)
    if loss_fn is None:
        raise UserInputError(
            f"unknown loss {name!r}; accepted: {', '.join(ACCEPTED_LOSS_NAMES)} "
            "(or a class/instance with one of these names)"
        )
    config: dict[str, float | str] = {}
    kw = dict(kwargs)
    _pop_fixed(kw, name, "ignore_index", -100, "labels use -100 for ignored positions")
    if norm.startswith("grpo"):
        _grpo_config(name, kw, config)
    if loss_fn == "dpo":
        _dpo_config(name, kw, config)
    if norm in UPSTREAM_MEAN_LOSSES:
        config[UPSTREAM_MEAN] = 1.0
    if loss_fn == "cross_entropy":
        _cross_entropy_config(name, norm in UPSTREAM_MEAN_LOSSES, kw, config)
    if loss_fn == "infonce":
        _infonce_config(name, kw, config)
    for key, value in kw.items():
        if isinstance(value, bool):
            value = float(value)
        if not isinstance(value, (int, float, str)):
            raise UserInputError(f"loss config {key!r}: {value!r} must be a number or a string")
        config[key] = float(value) if not isinstance(value, str) else value
    return name, loss_fn, config


def _grpo_config(name: str, kw: dict, config: dict[str, float | str]) -> None:
    """GRPOLoss's arguments (popped from ``kw``) into ``config``: epsilon / epsilon_high as PPO's
    clip thresholds; no KL penalty, no entropy bonus."""
    beta = kw.pop("beta", 0.0)
    if beta:
        raise UserInputError(f"GRPOLoss: beta {beta!r} (KL penalty) is not supported; use 0")
    _pop_fixed(kw, name, "entropy_coef", 0.0, "no entropy bonus; use 0")
    if "epsilon" in kw:
        eps = float(kw.pop("epsilon"))
        high = kw.pop("epsilon_high", None)
        config["clip_low_threshold"] = 1.0 - eps
        config["clip_high_threshold"] = 1.0 + float(eps if high is None else high)
    elif kw.get("epsilon_high") is not None:
        config["clip_high_threshold"] = 1.0 + float(kw.pop("epsilon_high"))
    kw.pop("epsilon_high", None)


def _dpo_config(name: str, kw: dict, config: dict[str, float | str]) -> None:
    """DPOLoss's arguments (popped from ``kw``) into ``config``: the sigmoid loss only, no label
    smoothing, ``reference_free`` as a flag."""
    loss_type = kw.pop("loss_type", "sigmoid")
    if loss_type not in DPO_LOSS_TYPES:
        raise UserInputError(
            f"{name}: loss_type {loss_type!r} is not supported; accepted: "
            f"{', '.join(DPO_LOSS_TYPES)}"
        )
    _pop_fixed(kw, name, "label_smoothing", 0.0, "use 0")
    if _flag_value(name, "reference_free", kw.pop("reference_free", False)):
        config["reference_free"] = 1.0


def _cross_entropy_config(
    name: str, upstream: bool, kw: dict, config: dict[str, float | str]
) -> None:
    """The reduction of a cross-entropy loss: upstream's class (``upstream``) takes mean (its
    default) or sum; Tinker's cross_entropy is a sum only."""
    if not upstream:
        _pop_fixed(kw, name, "reduction", "sum", "Tinker's cross_entropy is a sum")
        return
    reduction = kw.pop("reduction", "mean")
    if reduction not in CE_REDUCTIONS:
        raise UserInputError(
            f"{name}: reduction {reduction!r} is not supported; accepted: mean, sum"
        )
    config[UPSTREAM_MEAN] = float(reduction == "mean")


def _infonce_config(name: str, kw: dict, config: dict[str, float | str]) -> None:
    """InfonceLoss's arguments (popped from ``kw``) into ``config``."""
    if "temperature" in kw:
        t = kw.pop("temperature")
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t <= 0:
            raise UserInputError(f"{name}: temperature {t!r} must be a finite number > 0")
        config["temperature"] = float(t)
    if "use_batch" in kw:
        config["use_batch"] = float(_flag_value(name, "use_batch", kw.pop("use_batch")))
    _pop_fixed(
        kw, name, "hard_negatives", None,
        "only None: each group keeps its own negatives (anchor, positive, negatives...)",
    )  # fmt: skip
    for flag in ("mask_fake_negative", "include_qq", "include_dd"):
        _pop_fixed(kw, name, flag, False, "use False")
    margin = kw.pop("fake_neg_margin", 0.1)  # only read with mask_fake_negative
    if isinstance(margin, bool) or not isinstance(margin, (int, float)):
        raise UserInputError(f"{name}: fake_neg_margin {margin!r} must be a number")
    _pop_fixed(kw, name, "process_group", None, "the server runs the loss on one device")


# ----------------------------------------------------------------------------------- optimizer

_IGNORED_OPTIM_KW = {"foreach", "fused", "capturable", "differentiable"}


@dataclass
class OptimizerConfig:
    lr: float = DEFAULT_LR
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-12
    weight_decay: float = 0.0
    name: str = "AdamW"


#: accepted optimizer names → their defaults (lr is always DEFAULT_LR). Adam is AdamW with
#: weight_decay 0 (no decay term at all, so the two are the same update), with torch's defaults.
OPTIMIZERS = {
    "adamw": OptimizerConfig(),
    "adam": OptimizerConfig(betas=(0.9, 0.999), eps=1e-8, name="Adam"),
}


def optimizer_config(
    optimizer: Any, lr: Any, betas: Any, eps: Any, weight_decay: Any, extra: Mapping[str, Any]
) -> OptimizerConfig:
    """Validate set_optimizer's arguments: AdamW or Adam, as a name, the class, or an instance
    (whose ``defaults`` supply the hyper-parameters not passed explicitly)."""
    if isinstance(optimizer, str):
        name = optimizer
    elif isinstance(optimizer, type):
        name = optimizer.__name__
    else:
        name = type(optimizer).__name__
        defaults = getattr(optimizer, "defaults", {}) or {}
        lr = defaults.get("lr", lr) if lr is None else lr
        betas = defaults.get("betas", betas) if betas is None else betas
        eps = defaults.get("eps", eps) if eps is None else eps
        weight_decay = defaults.get("weight_decay") if weight_decay is None else weight_decay
    d = OPTIMIZERS.get(name.lower())
    if d is None:
        raise UserInputError(f"unsupported optimizer {name!r}; accepted: AdamW, Adam")
    if d.name == "Adam" and weight_decay not in (None, 0, 0.0):
        raise UserInputError(
            f"set_optimizer: weight_decay {weight_decay!r} with Adam (coupled L2 penalty) is not "
            "available; use weight_decay=0, or 'AdamW' for decoupled weight decay"
        )
    bad = sorted(set(extra) - _IGNORED_OPTIM_KW)
    if bad:
        raise UserInputError(f"set_optimizer: unsupported argument(s) {', '.join(bad)}")
    cfg = OptimizerConfig(
        lr=d.lr if lr is None else lr,
        betas=d.betas if betas is None else betas,
        eps=d.eps if eps is None else eps,
        weight_decay=d.weight_decay if weight_decay is None else weight_decay,
    )
    try:
        b1, b2 = (float(b) for b in cfg.betas)
    except (TypeError, ValueError):
        raise UserInputError(f"set_optimizer: betas {cfg.betas!r} must be two numbers") from None
    checks = [
        ("lr", cfg.lr, lambda v: v >= 0, ">= 0"),
        ("betas[0]", b1, lambda v: 0 <= v < 1, "in [0, 1)"),
        ("betas[1]", b2, lambda v: 0 <= v < 1, "in [0, 1)"),
        ("eps", cfg.eps, lambda v: v > 0, "> 0"),
        ("weight_decay", cfg.weight_decay, lambda v: v >= 0, ">= 0"),
    ]
    for fname, v, ok, rule in checks:
        if (
            isinstance(v, bool)
            or not isinstance(v, (int, float))
            or not math.isfinite(v)
            or not ok(v)
        ):
            raise UserInputError(f"set_optimizer: {fname} {v!r} must be a finite number {rule}")
    return OptimizerConfig(float(cfg.lr), (b1, b2), float(cfg.eps), float(cfg.weight_decay), d.name)


def check_clip(max_grad_norm: Any, norm_type: Any) -> float:
    """clip_grad_norm's arguments: only the L2 norm; a finite max_grad_norm >= 0 (0 = off)."""
    if norm_type != 2:
        raise UserInputError(f"clip_grad_norm: norm_type {norm_type!r} unsupported; only 2")
    v = max_grad_norm
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
        raise UserInputError(f"clip_grad_norm: max_grad_norm {v!r} must be a number >= 0")
    return float(v)


# ----------------------------------------------------------------------------------- schedules

_SCHEDULE_ALIASES = {
    "constant": "constant",
    "constantlr": "constant",
    "constantwarmupscheduler": "constant",
    "linear": "linear",
    "linearwarmupscheduler": "linear",
    "linearscheduler": "linear",
    "cosine": "cosine",
    "cosinewarmupscheduler": "cosine",
    "cosinescheduler": "cosine",
}
_SCHEDULE_KW = {
    "constant": {"warmup_steps"},
    "linear": {"warmup_steps", "total_steps"},
    "cosine": {"warmup_steps", "total_steps", "min_lr_ratio", "min_lr"},
}
_KW_ALIASES = {
    "num_warmup_steps": "warmup_steps",
    "num_training_steps": "total_steps",
    "max_steps": "total_steps",
}


@dataclass
class LrSchedule:
    """lr at scheduler position t (number of lr_step() calls so far) = base lr × multiplier(t).

    As HF's ``get_*_schedule_with_warmup``: warm-up is t / warmup_steps (so the first step of a
    warm-up runs at lr 0); ``linear`` then decays to 0 at ``total_steps``; ``cosine`` decays along
    a half cosine to ``min_lr_ratio`` (or absolute ``min_lr``) at ``total_steps``; both stay at
    their end value afterwards. A callable schedule is ``fn(t) -> multiplier``.
    """

    name: str
    kwargs: dict[str, Any] = field(default_factory=dict)
    fn: Callable[[int], float] | None = None

    def multiplier(self, t: int, base_lr: float) -> float:
        if self.fn is not None:
            return float(self.fn(t))
        kw = self.kwargs
        warmup = int(kw.get("warmup_steps", 0))
        if t < warmup:
            return t / warmup
        if self.name == "constant":
            return 1.0
        total = int(kw["total_steps"])
        progress = min(1.0, (t - warmup) / max(1, total - warmup))
        if self.name == "linear":
            return max(0.0, 1.0 - progress)
        floor = float(kw.get("min_lr_ratio", 0.0))
        if "min_lr" in kw:
            floor = float(kw["min_lr"]) / base_lr if base_lr > 0 else 0.0
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, **({"fn": repr(self.fn)} if self.fn else self.kwargs)}


def make_schedule(scheduler: Any, kwargs: Mapping[str, Any]) -> LrSchedule:
    kw = {_KW_ALIASES.get(k, k): v for k, v in kwargs.items()}
    if isinstance(scheduler, type) and scheduler.__name__ == "LambdaLR" and "lr_lambda" in kw:
        scheduler = kw.pop("lr_lambda")  # torch's LambdaLR(lr_lambda=...) is a callable schedule
    if callable(scheduler) and not isinstance(scheduler, type):
        if kw:
            raise UserInputError(
                f"set_lr_scheduler: a callable takes no arguments, got {sorted(kw)}"
            )
        return LrSchedule(name="callable", fn=cast(Callable[[int], float], scheduler))
    name = (
        scheduler if isinstance(scheduler, str) else getattr(scheduler, "__name__", repr(scheduler))
    )
    canonical = _SCHEDULE_ALIASES.get(_norm(name))
    if canonical is None:
        raise UserInputError(
            f"unknown lr scheduler {name!r}; accepted: constant, linear, cosine, or a callable "
            "step -> lr multiplier"
        )
    bad = sorted(set(kw) - _SCHEDULE_KW[canonical])
    if bad:
        raise UserInputError(
            f"lr scheduler {canonical!r}: unsupported argument(s) {', '.join(bad)}"
        )
    if canonical != "constant" and "total_steps" not in kw:
        raise UserInputError(
            f"lr scheduler {canonical!r}: total_steps (num_training_steps) is required"
        )
    for k, v in kw.items():
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
            raise UserInputError(f"lr scheduler {canonical!r}: {k} {v!r} must be a number >= 0")
    return LrSchedule(name=canonical, kwargs=dict(kw))
