"""PEFT-format adapter files: ``adapter_model.safetensors`` + ``adapter_config.json``.

Owns the names of the two files, the ``adapter_config.json`` body peft's ``LoraConfig`` accepts,
writing both files from plain tensors (so the Transformers and Megatron backends write the same
format), and reading them back: the config as a `LoraSpec` (CheckpointError for anything we
cannot honour) and the tensors checked against the expected names and shapes. Tensors and folders
only; putting them into a model is engine/backends/lora.py's.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors.torch import load_file, save

from engine.backends.age_seal import Sealer, plain
from engine.errors import CheckpointError
from engine.protocol import LoraSpec
from engine.rules import ATTN_TARGETS, MLP_TARGETS, UNEMBED_TARGETS, VISION_TARGETS

ADAPTER_WEIGHTS_NAME = "adapter_model.safetensors"
ADAPTER_CONFIG_NAME = "adapter_config.json"


def peft_config_dict(spec: LoraSpec, target_modules: list[str], base_model_name: str) -> dict:
    """An ``adapter_config.json`` body that peft's LoraConfig accepts (only fields it knows)."""
    return {
        "alpha_pattern": {},
        "base_model_name_or_path": base_model_name or None,
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "layers_pattern": None,
        "layers_to_transform": None,
        "lora_alpha": spec.alpha,
        "lora_dropout": 0.0,
        "modules_to_save": None,
        "peft_type": "LORA",
        "r": spec.rank,
        "rank_pattern": {},
        "revision": None,
        "target_modules": sorted(target_modules),
        "task_type": "CAUSAL_LM",
        "use_dora": False,
        "use_rslora": False,
    }


def write_adapter_files(
    directory: str | Path,
    tensors: Mapping[str, torch.Tensor],
    spec: LoraSpec,
    targets: list[str],
    base_model_name: str = "",
    seal: Sealer = plain,
) -> list[Path]:
    """``adapter_model.safetensors`` (float32, PEFT names) + ``adapter_config.json`` for
    ``targets`` (short module names) into an existing ``directory``; returns their paths. Both
    are built in memory and pass through ``seal`` (engine/backends/age_seal.py) on their way to
    the disk, so an encrypted export never writes plaintext."""
    directory = Path(directory)
    tensors = {
        k: t.detach().to("cpu", torch.float32).contiguous().clone() for k, t in tensors.items()
    }
    body = peft_config_dict(spec, sorted(targets), base_model_name)
    files = {
        ADAPTER_WEIGHTS_NAME: save(tensors, metadata={"format": "pt"}),
        ADAPTER_CONFIG_NAME: (json.dumps(body, indent=2, sort_keys=True) + "\n").encode(),
    }
    paths = []
    for name, data in files.items():
        out_name, out = seal(name, data)
        (directory / out_name).write_bytes(out)
        paths.append(directory / out_name)
    return paths


def read_adapter_config(directory: str | Path, seed: int = 0) -> LoraSpec:
    """Parse ``adapter_config.json`` into a LoraSpec; CheckpointError if we cannot honour it."""
    path = Path(directory) / ADAPTER_CONFIG_NAME
    try:
        cfg = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise CheckpointError(f"cannot read {path}: {e}") from None
    if not isinstance(cfg, dict) or cfg.get("peft_type", "LORA") != "LORA":
        raise CheckpointError(f"{path}: not a LoRA adapter config")
    unsupported = [
        k
        for k, ok in (
            ("use_dora", not cfg.get("use_dora")),
            ("use_rslora", not cfg.get("use_rslora")),
            ("rank_pattern", not cfg.get("rank_pattern")),
            ("alpha_pattern", not cfg.get("alpha_pattern")),
            ("bias", cfg.get("bias", "none") == "none"),
            ("modules_to_save", not cfg.get("modules_to_save")),
            ("fan_in_fan_out", not cfg.get("fan_in_fan_out")),
        )
        if not ok
    ]
    if unsupported:
        raise CheckpointError(f"{path}: unsupported LoRA options: {', '.join(unsupported)}")
    targets = cfg.get("target_modules")
    if isinstance(targets, str):
        targets = [*ATTN_TARGETS, *MLP_TARGETS] if targets == "all-linear" else None
    known = set(ATTN_TARGETS) | set(MLP_TARGETS) | set(UNEMBED_TARGETS) | set(VISION_TARGETS)
    if not targets or not set(targets) <= known:
        raise CheckpointError(f"{path}: target_modules {cfg.get('target_modules')!r} not supported")
    try:
        rank, alpha = int(cfg["r"]), float(cfg["lora_alpha"])
    except (KeyError, TypeError, ValueError):
        raise CheckpointError(f"{path}: missing or invalid r / lora_alpha") from None
    # Tinker's switches are per group; a config naming part of a group cannot be represented.
    groups = [set(ATTN_TARGETS), set(MLP_TARGETS), set(UNEMBED_TARGETS), set(VISION_TARGETS)]
    flags = []
    for group in groups:
        chosen = group & set(targets)
        if chosen and chosen != group:
            raise CheckpointError(
                f"{path}: target_modules must name all of {sorted(group)} or none"
            )
        flags.append(bool(chosen))
    return LoraSpec(
        rank=rank,
        alpha=alpha,
        train_attn=flags[0],
        train_mlp=flags[1],
        train_unembed=flags[2],
        train_vision=flags[3],
        seed=seed,
    )


def read_adapter_tensors(
    directory: str | Path, shapes: dict[str, tuple[int, ...]]
) -> dict[str, torch.Tensor]:
    """The tensors of ``adapter_model.safetensors``, checked to be exactly the names and shapes
    in ``shapes`` (CheckpointError naming the first mismatch)."""
    path = Path(directory) / ADAPTER_WEIGHTS_NAME
    try:
        tensors = load_file(str(path))
    except Exception as e:  # safetensors raises its own error types for corrupt files
        raise CheckpointError(f"cannot read {path}: {e}") from None
    missing = sorted(set(shapes) - set(tensors))
    unexpected = sorted(set(tensors) - set(shapes))
    if missing or unexpected:
        raise CheckpointError(
            f"{path}: tensors do not match the adapter "
            f"(missing {missing[:3]}, unexpected {unexpected[:3]})"
        )
    for key, shape in shapes.items():
        if tuple(tensors[key].shape) != tuple(shape):
            raise CheckpointError(
                f"{path}: {key} has shape {tuple(tensors[key].shape)}, expected {tuple(shape)}"
            )
    return tensors
