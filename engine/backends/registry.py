"""Backends by name: the only place that maps a config's ``backend`` / ``sampler_type`` to a class.

Owns `build_training_backend` and `build_sampling_backend`, which the Trainer and the Sampler
call when no backend is injected. Every builder imports its backend module inside the function,
so importing this registry (or building ``mock``) loads no torch, transformers or vLLM; an
optional dependency that is missing fails only the model that names it. An unknown name is a
`ConfigError` listing the known ones (engine/config validates the same names at load time).

Names: training ``transformers`` (HF + multi-LoRA, CPU or one GPU), ``megatron`` (Megatron-Core,
TP x PP ranks per replica; the ``megatron`` extra), ``mock`` (deterministic, no torch: routing
tests only); sampling ``torch``, ``vllm`` (GPU, the ``gpu`` extra), ``mock``.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING

from engine.errors import ConfigError

if TYPE_CHECKING:
    from engine.backends.base import SamplingBackend, TrainingBackend
    from engine.config import ModelConfig


def _model_dir(model: ModelConfig, data_dir: str) -> str:
    """The model's HF folder (building the built-in tiny model under ``data_dir`` if needed)."""
    from engine.base_models.registry import resolve_model_dir

    return str(resolve_model_dir(model.name, data_dir, model.path))


# -- training --------------------------------------------------------------------------------
def _transformers(model: ModelConfig, data_dir: str) -> TrainingBackend:
    from engine.backends.placement import resolve_placement
    from engine.backends.train_transformers import TransformersTrainingBackend

    where = f"models[{model.name}].trainer"
    device, dtype = resolve_placement(model.trainer.num_gpus, model.dtype, where)
    return TransformersTrainingBackend(
        _model_dir(model, data_dir),
        max_lora_rank=model.max_lora_rank,
        base_model_name=model.name,
        max_image_pixels=model.images.max_pixels,
        device=device,
        dtype=dtype,
        loss_limits=_loss_limits(model),
    )


def _loss_limits(model: ModelConfig):
    from engine.backends.custom_loss_run import LossLimits

    return LossLimits(**model.custom_loss.model_dump())


def _megatron(model: ModelConfig, data_dir: str) -> TrainingBackend:
    from engine.backends.megatron.backend import MegatronTrainingBackend

    mc = model.megatron_config()
    return MegatronTrainingBackend(
        _model_dir(model, data_dir),
        tensor_parallel=mc.tensor_parallel,
        pipeline_parallel=mc.pipeline_parallel,
        max_lora_rank=model.max_lora_rank,
        base_model_name=model.name,
        micro_batch_tokens=mc.micro_batch_tokens,
        params_dtype=mc.params_dtype,
        recompute=mc.recompute_granularity,
        worker_num_cpus=mc.worker_num_cpus,
        worker_num_gpus=mc.worker_num_gpus,
        loss_limits=_loss_limits(model),
    )


def _mock_training(model: ModelConfig, data_dir: str) -> TrainingBackend:
    from engine.backends.mock import MockTrainingBackend

    return MockTrainingBackend(
        max_lora_rank=model.max_lora_rank,
        max_positions=model.max_context_length,
        base_model_name=model.name,
    )


# -- sampling --------------------------------------------------------------------------------
def _torch(model: ModelConfig, data_dir: str) -> SamplingBackend:
    from engine.backends.placement import resolve_placement
    from engine.backends.sample_torch import TorchSamplingBackend

    where = f"models[{model.name}].sampler"
    device, dtype = resolve_placement(model.sampler.num_gpus, model.dtype, where)
    return TorchSamplingBackend(
        _model_dir(model, data_dir),
        max_image_pixels=model.images.max_pixels,
        device=device,
        dtype=dtype,
    )


def _vllm(model: ModelConfig, data_dir: str) -> SamplingBackend:
    from engine.backends.sample_vllm import VllmSamplingBackend  # vllm itself: in its __init__

    args = dict(model.vllm_engine_args)
    if model.max_context_length is not None:
        args.setdefault("max_model_len", model.max_context_length)
    return VllmSamplingBackend(
        _model_dir(model, data_dir), max_lora_rank=model.max_lora_rank, engine_args=args
    )


def _mock_sampling(model: ModelConfig, data_dir: str) -> SamplingBackend:
    from engine.backends.mock_sampling import MockSamplingBackend

    return MockSamplingBackend(max_positions=model.max_context_length)


TRAINING_BACKENDS: dict[str, Callable[[ModelConfig, str], TrainingBackend]] = {
    "transformers": _transformers,
    "megatron": _megatron,
    "mock": _mock_training,
}
SAMPLING_BACKENDS: dict[str, Callable[[ModelConfig, str], SamplingBackend]] = {
    "torch": _torch,
    "vllm": _vllm,
    "mock": _mock_sampling,
}


def _lookup(table: dict, kind: str, name: str) -> Callable:
    try:
        return table[name]
    except (KeyError, TypeError):  # TypeError: an unhashable name from a hand-built config
        known = ", ".join(sorted(table))
        raise ConfigError(f"unknown {kind} {name!r}; known: {known}") from None


def set_torch_threads(threads: int | None) -> int:
    """torch's intra-op threads for this process: ``threads``, or the cores it may run on.
    Returns the count set. Ray sets OMP_NUM_THREADS=1 for an actor with num_cpus < 2, so
    without this a Trainer computes on one core of many (measured on 2 cores: the service path
    at 0.54 of a bare 2-thread loop on the 25 M model)."""
    import torch

    n = threads or (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 0)
    n = n or os.cpu_count() or 1
    torch.set_num_threads(n)
    return n


def _default_threads(model: ModelConfig, configured: int | None) -> int | None:
    """``configured``, else 1 for the built-in tiny models (their GEMMs are too small for a
    second thread: 0.38 -> 0.33 of a bare loop with 2 on 2 cores, benchmarks/service_path.py),
    else None (the host's cores)."""
    from engine.config import BUILTIN_MODELS

    if configured is None and model.path is None and model.name in BUILTIN_MODELS:
        return 1
    return configured


def build_training_backend(model: ModelConfig, data_dir: str) -> TrainingBackend:
    """The training backend ``model.backend`` names, for ``model`` (ConfigError if unknown);
    torch's threads are set first (``trainer.torch_threads``)."""
    build = _lookup(TRAINING_BACKENDS, "training backend", model.backend)
    if model.backend != "mock":  # mock loads no torch
        set_torch_threads(_default_threads(model, model.trainer.torch_threads))
    return build(model, data_dir)


def build_sampling_backend(model: ModelConfig, data_dir: str) -> SamplingBackend:
    """The sampling backend ``model.sampler_type`` names, for ``model`` (ConfigError if unknown);
    torch's threads are set first (``sampler.torch_threads``)."""
    build = _lookup(SAMPLING_BACKENDS, "sampler_type", model.sampler_type)
    if model.sampler_type != "mock":
        set_torch_threads(_default_threads(model, model.sampler.torch_threads))
    return build(model, data_dir)
