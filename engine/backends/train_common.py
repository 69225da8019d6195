"""What both training backends (Transformers, Megatron) share about adapters and their optimizer.

Owns the per-adapter weights and optimizer (`TrainableAdapter`), one adapter's request and its
results inside a fused run (`AdapterPass`), the spec and Adam-parameter checks with their error
texts, the AdamW construction (single-tensor path: bit-reproducible), and one optimizer step given
the gradient's global norm (clipping as ``torch.nn.utils.clip_grad_norm_``). The backends differ
only in where gradients live and how their norm is summed (one process, or shards over
tensor/pipeline ranks).
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import platform
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from engine.backends import losses
from engine.backends.train_rows import Request
from engine.errors import BackendError, CheckpointError, EngineError, UserInputError
from engine.protocol import (
    AdamParams,
    ForwardBackwardInput,
    ForwardBackwardOutput,
    LoraSpec,
    OptimStepOutput,
)

log = logging.getLogger(__name__)


def _cpu_name() -> str:
    """The CPU's model name (Linux: /proc/cpuinfo), else what the platform says."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def device_fingerprint(device: torch.device, dtype: torch.dtype, architecture: str) -> dict:
    """`TrainingBackend.device_fingerprint` for a torch model on ``device``: the device's name
    (CPU model and the cores this process may use, or the GPU's name), torch's threads, the
    parameters' dtype, torch's version and a hash of the model's architecture (its config)."""
    import transformers

    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        cores = torch.cuda.device_count()
    else:
        name = _cpu_name()
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {
        "device": device.type,
        "name": name,
        "cores": cores,
        "threads": torch.get_num_threads(),
        "dtype": str(dtype).removeprefix("torch."),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "architecture": hashlib.sha256(architecture.encode()).hexdigest()[:16],
    }


@dataclass
class TrainableAdapter:
    """One adapter as a backend trains it: its spec, parameters, optimizer and step count."""

    spec: LoraSpec
    params: dict[str, nn.Parameter]  # PEFT name → parameter (or this rank's shard), in order
    optimizer: torch.optim.AdamW
    step: int = 0
    has_grad: bool = False


@dataclass
class AdapterPass:
    """One adapter's validated request inside a (possibly fused) run, and its results so far."""

    slot: int
    adapter_id: str
    req: Request
    outputs: list[dict[str, np.ndarray]]
    metrics: losses.MetricSums = field(default_factory=losses.MetricSums)

    def result(self) -> ForwardBackwardOutput:
        return ForwardBackwardOutput(outputs=self.outputs, metrics=self.metrics.result())


def new_optimizer(params: dict[str, nn.Parameter]) -> torch.optim.AdamW:
    # foreach=False: the single-tensor path gives bit-reproducible results across runs.
    return torch.optim.AdamW(list(params.values()), lr=1e-4, foreach=False)


def spec_shape(spec: LoraSpec) -> tuple:
    """What must match for a checkpoint to load into an existing adapter (not the seed)."""
    return (
        spec.rank,
        spec.alpha,
        spec.train_attn,
        spec.train_mlp,
        spec.train_unembed,
        spec.train_vision,
    )


def check_reload(st: TrainableAdapter, spec: LoraSpec, adapter_id: str, path: object) -> None:
    """A checkpoint loaded into an existing adapter must have its shape (the seed may differ:
    it only matters at init)."""
    if spec_shape(st.spec) != spec_shape(spec):
        raise CheckpointError(
            f"checkpoint {path} (rank {spec.rank}, alpha {spec.alpha}) does not match "
            f"adapter {adapter_id!r} (rank {st.spec.rank}, alpha {st.spec.alpha}) or its "
            "target modules"
        )


def finish_load(st: TrainableAdapter, optimizer: torch.optim.AdamW, step: int, with_opt: bool):
    """Install a loaded adapter's optimizer; a weights-only load starts a fresh optimizer, so
    its step count restarts too."""
    st.optimizer = optimizer
    st.step = step if with_opt else 0
    st.has_grad = False


def check_spec(
    spec: LoraSpec,
    max_rank: int,
    model_name: str,
    error: type[Exception],
    *,
    has_vision: bool = False,
) -> None:
    r = spec.rank
    if not isinstance(r, int) or isinstance(r, bool) or r < 1 or r & (r - 1):
        raise error(f"lora_config.rank {r!r} must be a power of 2 (1, 2, 4, ...)")
    if r > max_rank:
        raise error(f"lora_config.rank {r} exceeds max LoRA rank {max_rank} for model {model_name}")
    a = spec.alpha
    if not (isinstance(a, (int, float)) and math.isfinite(a) and a > 0):
        raise error(f"lora_config.alpha {a!r} must be a positive finite number")
    if not (spec.train_attn or spec.train_mlp or spec.train_unembed or spec.train_vision):
        raise error("lora_config: one of train_attn, train_mlp, train_unembed must be true")
    if spec.train_vision and not has_vision:
        raise error(
            f"lora_config.train_vision: model {model_name} has no vision tower this backend "
            "trains (vision-language models on the transformers backend only)"
        )


def check_adam(p: AdamParams) -> None:
    in_01 = (lambda v: 0 <= v < 1, "in [0, 1)")
    non_neg = (lambda v: v >= 0, ">= 0")
    rules = {
        "learning_rate": non_neg,
        "beta1": in_01,
        "beta2": in_01,
        "eps": (lambda v: v > 0, "> 0"),
        "weight_decay": non_neg,
        "grad_clip_norm": non_neg,
    }
    for name, (ok, rule) in rules.items():
        v = getattr(p, name)
        if not (isinstance(v, (int, float)) and math.isfinite(v) and ok(v)):
            raise UserInputError(f"adam_params.{name} {v!r} must be a finite number {rule}")


def require_grad(st: TrainableAdapter) -> list[torch.Tensor]:
    """The adapter's gradients for a step (UserInputError without one); a parameter unused in
    the graph gets a zero gradient, not a skipped step."""
    if not st.has_grad:
        raise UserInputError(
            "optim_step: no gradient accumulated since the last optim_step; "
            "call forward_backward first"
        )
    grads = []
    for p in st.params.values():
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        grads.append(p.grad)
    return grads


def adam_step(st: TrainableAdapter, grads: list[torch.Tensor], norm: float, params: AdamParams):
    """Clip ``grads`` (whose global L2 norm is ``norm``), step, clear; the step's metrics."""
    with torch.no_grad():
        if params.grad_clip_norm > 0 and norm > params.grad_clip_norm:
            coef = params.grad_clip_norm / (norm + 1e-6)  # as torch.nn.utils.clip_grad_norm_
            for g in grads:
                g.mul_(coef)
    for group in st.optimizer.param_groups:
        group["lr"] = float(params.learning_rate)
        group["betas"] = (float(params.beta1), float(params.beta2))
        group["eps"] = float(params.eps)
        group["weight_decay"] = float(params.weight_decay)
    st.optimizer.step()
    st.optimizer.zero_grad(set_to_none=True)
    st.step += 1
    st.has_grad = False
    return OptimStepOutput(
        metrics={
            "grad_norm": norm,
            "learning_rate": float(params.learning_rate),
            "step": float(st.step),
        }
    )


def run_fused(
    items: Sequence[tuple[str, ForwardBackwardInput]],
    prepare: Callable[[int, str, ForwardBackwardInput], AdapterPass],
    execute: Callable[..., None],
) -> list[ForwardBackwardOutput | EngineError]:
    """`TrainingBackend.forward_backward_many` over a backend's ``prepare(slot, adapter_id, inp)``
    (validates, raises the item's EngineError) and ``execute(jobs, grad=...)`` (one fused pass
    of distinct adapters, all or nothing: a failed pass leaves every adapter's gradient as it
    was). Each slot gets its output or its own EngineError: when a fused pass fails, each of its
    items runs again alone, so one tenant's failing loss (an index out of range on its values)
    fails only its own item, and the others get what an unfused step gives. Duplicate adapter
    ids raise ValueError."""
    seen: set[str] = set()
    for aid, _ in items:
        if aid in seen:
            raise ValueError(f"forward_backward_many: adapter {aid!r} appears more than once")
        seen.add(aid)
    results: list[ForwardBackwardOutput | EngineError | None] = [None] * len(items)
    jobs: list[AdapterPass] = []
    for slot, (aid, inp) in enumerate(items):
        try:
            jobs.append(prepare(slot, aid, inp))
        except EngineError as e:
            results[slot] = e
    for grad in (True, False):
        group = [j for j in jobs if j.req.forward_only != grad]
        if not group:
            continue
        err = _execute(execute, group, grad)
        if err is not None and len(group) > 1:
            # Which item failed the pass is unknown (the error may be any item's, or the pass's
            # size), so each runs alone, from fresh outputs and metrics.
            log.info("fused pass of %d items failed (%s); running them one by one", len(group), err)
            for j in group:
                alone = AdapterPass(j.slot, j.adapter_id, j.req, [{} for _ in j.req.data])
                e = _execute(execute, [alone], grad)
                results[j.slot] = alone.result() if e is None else e
            continue
        for j in group:
            results[j.slot] = j.result() if err is None else err
    return results  # type: ignore[return-value]


def _execute(
    execute: Callable[..., None], jobs: list[AdapterPass], grad: bool
) -> EngineError | None:
    """``execute(jobs, grad=grad)``; its failure as an EngineError (a compute failure: a
    BackendError), or None."""
    try:
        execute(jobs, grad=grad)
    except EngineError as e:
        return e
    except Exception as e:
        log.exception("forward_backward failed")
        err = BackendError(f"forward_backward failed: {type(e).__name__}: {e}")
        err.__cause__ = e
        return err
    return None
