"""Parsing a request's ``loss_fn_config`` against its loss's `LossSpec` (engine/backends/losses.py).

Owns `parse_config`: the accepted keys with their defaults filled in, numbers and flags as the
wire may spell them (``"0.5"``, ``"true"``, 1/0), ``disable_lora`` (forward_only only), and each
loss's bounds on its values, each refusal a UserInputError naming the key.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from engine.backends.losses import (
    DISABLE_LORA,
    MEAN_REDUCTION,
    NUM_CHOSEN_TOKENS,
    NUM_PAIRS,
    LossSpec,
    clip_range,
)
from engine.errors import UserInputError
from engine.rules import STABLE_REINFORCE

_TRUE = ("1", "1.0", "true", "yes", "on")
_FALSE = ("0", "0.0", "false", "no", "off", "")


def _number(key: str, value: object) -> float:
    if isinstance(value, bool):
        value = float(value)
    try:
        out = float(value.strip()) if isinstance(value, str) else float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        out = math.nan
    if not math.isfinite(out):
        raise UserInputError(f"loss_fn_config.{key}: {value!r} must be a finite number")
    return out


def _flag(key: str, value: object) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, (int, float)) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in _TRUE + _FALSE:
        return value.strip().lower() in _TRUE
    raise UserInputError(f"loss_fn_config.{key}: {value!r} must be true/false (or 1/0)")


def parse_config(
    spec: LossSpec, raw: Mapping[str, object] | None, forward_only: bool
) -> tuple[dict[str, float], bool]:
    """Validate ``loss_fn_config`` for ``spec``: (config with defaults filled in, disable_lora)."""
    cfg = dict(spec.config)
    disable = False
    accepted = sorted([*spec.config, DISABLE_LORA])
    for key, value in (raw or {}).items():
        if key == DISABLE_LORA:
            disable = _flag(key, value)
        elif key in spec.config:
            cfg[key] = _number(key, value)
        else:
            raise UserInputError(
                f"loss_fn_config.{key}: unknown key for loss_fn {spec.name!r}; "
                f"accepted: {', '.join(accepted)}"
            )
    if disable and not forward_only:
        raise UserInputError(
            f"loss_fn_config.{DISABLE_LORA}: only allowed with forward_only (it computes "
            "reference logprobs of the base model, which has no trainable parameters)"
        )
    if "clip_low_threshold" in cfg:
        lo, hi = clip_range(cfg)
        if lo < 0 or hi < lo:
            raise UserInputError(
                f"loss_fn_config: need 0 <= clip_low_threshold <= clip_high_threshold "
                f"(got {lo}, {hi})"
            )
    if spec.name == STABLE_REINFORCE:
        for band in ("token_mask", "seq_mask"):
            lo, hi = cfg[f"{band}_low"], cfg[f"{band}_high"]
            if not 0 <= lo <= 1 <= hi:
                # a band without 1 would mask every on-policy token: nothing would train
                raise UserInputError(
                    f"loss_fn_config: need 0 <= {band}_low <= 1 <= {band}_high (got {lo}, {hi})"
                )
    if spec.name == "dro" and cfg["beta"] < 0:
        raise UserInputError(f"loss_fn_config.beta: {cfg['beta']} must be >= 0")
    if spec.name == "infonce":
        if cfg["temperature"] <= 0:
            raise UserInputError(f"loss_fn_config.temperature: {cfg['temperature']} must be > 0")
        if cfg["use_batch"] not in (0.0, 1.0):
            raise UserInputError(f"loss_fn_config.use_batch: {cfg['use_batch']} must be 1 or 0")
    if spec.name == "dpo":
        if cfg["beta"] <= 0:
            raise UserInputError(f"loss_fn_config.beta: {cfg['beta']} must be > 0")
        if cfg["sft_weight"] < 0:
            raise UserInputError(f"loss_fn_config.sft_weight: {cfg['sft_weight']} must be >= 0")
        for key in (MEAN_REDUCTION, NUM_PAIRS, NUM_CHOSEN_TOKENS):
            if cfg[key] < 0:
                raise UserInputError(f"loss_fn_config.{key}: {cfg[key]} must be >= 0")
    return cfg, disable
