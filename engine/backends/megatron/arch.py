"""Which Hugging Face models the Megatron backend can host, read from ``config.json`` (no torch).

Owns `Arch` (the shape facts the mapping and the model builder need) and `arch_from_hf_config`,
which refuses, with a ConfigError naming the field, anything the mapping does not reproduce
exactly: other architectures (MoE, sliding window), RoPE scalings other than Megatron's llama3
(fixed low/high frequency factors 1 and 4, original 8192 positions: rotary_pos_embedding.py),
and parallel sizes the weights cannot be split by (TP must divide the KV groups, for our
group-wise QKV slicing, and the vocabulary; PP must divide the layers).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.errors import ConfigError

#: HF ``architectures[0]`` → family
FAMILIES = {
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "LlamaForCausalLM": "llama",
}
#: Megatron's hard-coded llama3 RoPE scaling constants (megatron/core/.../rotary_pos_embedding.py)
LLAMA3_FIXED = {
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


@dataclass(frozen=True)
class Arch:
    family: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_groups: int
    head_dim: int
    ffn_hidden_size: int
    vocab_size: int
    tied: bool
    qkv_bias: bool
    qk_norm: bool
    rope_theta: float
    rope_scaling_factor: float | None  # llama3 scaling factor, None without scaling
    rms_eps: float
    max_positions: int


def _get(cfg: dict[str, Any], key: str, default: Any = None) -> Any:
    value = cfg.get(key, default)
    if value is None:
        raise ConfigError(f"config.json: {key} is missing; the Megatron backend needs it")
    return value


def _rope(cfg: dict[str, Any]) -> tuple[float, float | None]:
    params = cfg.get("rope_parameters") or {}  # transformers 5 spelling
    scaling = cfg.get("rope_scaling") or params
    theta = cfg.get("rope_theta", params.get("rope_theta", 10000.0))
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind in (None, "default"):
        return float(theta), None
    if kind != "llama3":
        raise ConfigError(
            f"config.json: rope_scaling.rope_type {kind!r} is not supported by the Megatron "
            "backend (default and llama3 are); use backend 'transformers'"
        )
    for key, want in LLAMA3_FIXED.items():
        got = scaling.get(key)
        if got is None or float(got) != want:
            raise ConfigError(
                f"config.json: rope_scaling.{key} {got!r} must be {want:g} for the Megatron "
                "backend (Megatron hard-codes it); use backend 'transformers'"
            )
    return float(theta), float(_get(scaling, "factor"))


def arch_from_hf_config(cfg: dict[str, Any], *, tp: int = 1, pp: int = 1) -> Arch:
    """The `Arch` of an HF config dict, or a ConfigError naming the unsupported field."""
    archs = cfg.get("architectures") or []
    name = archs[0] if archs else None
    family = FAMILIES.get(str(name))
    if family is None:
        raise ConfigError(
            f"config.json: architectures {archs!r} is not supported by the Megatron backend "
            f"(supported: {', '.join(sorted(FAMILIES))}); use backend 'transformers'"
        )
    if cfg.get("use_sliding_window"):
        raise ConfigError(
            "config.json: use_sliding_window is not supported by the Megatron backend"
        )
    hidden = int(_get(cfg, "hidden_size"))
    heads = int(_get(cfg, "num_attention_heads"))
    groups = int(cfg.get("num_key_value_heads") or heads)
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    layers = int(_get(cfg, "num_hidden_layers"))
    vocab = int(_get(cfg, "vocab_size"))
    theta, factor = _rope(cfg)
    if family == "llama" and (cfg.get("attention_bias") or cfg.get("mlp_bias")):
        raise ConfigError("config.json: attention_bias/mlp_bias are not supported for llama")
    if cfg.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"config.json: hidden_act {cfg.get('hidden_act')!r} must be 'silu'")
    for key, size in (("tensor_parallel", tp), ("pipeline_parallel", pp)):
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise ConfigError(f"megatron.{key} {size!r} must be a positive integer")
    if groups % tp:
        raise ConfigError(
            f"megatron.tensor_parallel {tp} must divide num_key_value_heads {groups} "
            "(each rank holds whole KV groups)"
        )
    if vocab % tp:
        raise ConfigError(f"megatron.tensor_parallel {tp} must divide vocab_size {vocab}")
    if int(_get(cfg, "intermediate_size")) % tp:
        raise ConfigError(
            f"megatron.tensor_parallel {tp} must divide intermediate_size "
            f"{cfg['intermediate_size']}"
        )
    if layers % pp:
        raise ConfigError(f"megatron.pipeline_parallel {pp} must divide num_hidden_layers {layers}")
    return Arch(
        family=family,
        num_layers=layers,
        hidden_size=hidden,
        num_heads=heads,
        num_kv_groups=groups,
        head_dim=head_dim,
        ffn_hidden_size=int(cfg["intermediate_size"]),
        vocab_size=vocab,
        tied=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=family == "qwen2" or bool(cfg.get("attention_bias", False)),
        qk_norm=family == "qwen3",
        rope_theta=theta,
        rope_scaling_factor=factor,
        rms_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        max_positions=int(cfg.get("max_position_embeddings") or 1 << 30),
    )


def read_arch(model_dir: str | Path, *, tp: int = 1, pp: int = 1) -> Arch:
    """`arch_from_hf_config` of ``<model_dir>/config.json``."""
    path = Path(model_dir) / "config.json"
    try:
        cfg = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"cannot read {path}: {e}") from None
    return arch_from_hf_config(cfg, tp=tp, pp=pp)
