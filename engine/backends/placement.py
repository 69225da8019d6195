"""Where a torch backend's base model computes, and in which dtype.

A Trainer (``backend: transformers``) or torch Sampler replica with ``num_gpus > 0`` computes on
the GPU Ray gave it: Ray sets CUDA_VISIBLE_DEVICES per replica, so inside the replica that GPU is
``cuda:0``. Without GPUs it computes on CPU. A replica that asks for a GPU and sees none fails
at start-up with a `ConfigError` naming the field, instead of training on CPU unnoticed.

``dtype`` is the frozen base weights' dtype: ``auto`` is bfloat16 on a GPU that supports it and
float32 otherwise. LoRA weights, their gradients and the optimizer state stay float32 whatever
the base's dtype (as peft keeps them), so a bfloat16 base still steps float32 master weights;
the loss and logprobs are computed from float32 logits.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from engine.errors import ConfigError

if TYPE_CHECKING:
    import torch

#: the values of a model's ``dtype``
DTYPES = ("auto", "float32", "bfloat16")


def resolve_placement(num_gpus: float, dtype: str, where: str) -> tuple[torch.device, torch.dtype]:
    """(device, base dtype) of a replica reserving ``num_gpus``; ``where`` names the config
    section (e.g. ``models[twinkle/tiny-chat].trainer``) in errors."""
    import torch

    if dtype not in DTYPES:
        raise ConfigError(f"{where}: dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    if num_gpus > 0:
        if not torch.cuda.is_available():
            raise ConfigError(
                f"{where}.num_gpus is {num_gpus:g}, but this replica sees no CUDA device (torch "
                f"{torch.__version__}, CUDA build {torch.version.cuda or 'none'}, "
                f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}): install a "
                "CUDA build of torch on the GPU nodes, or set num_gpus: 0 to compute on CPU"
            )
        device = torch.device("cuda", 0)
    else:
        device = torch.device("cpu")
    if dtype == "auto":
        bf16 = device.type == "cuda" and torch.cuda.is_bf16_supported()
        return device, torch.bfloat16 if bf16 else torch.float32
    return device, getattr(torch, dtype)
