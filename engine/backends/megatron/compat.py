"""megatron-core on this process: the version gate, the CPU shims and the process groups.

megatron-core assumes CUDA in a few places that a CPU run (tests, CI: gloo) reaches; each shim
below is applied only when CUDA is absent, and only once:

1. ``torch.cuda.current_device`` → ``"cpu"``: device= arguments in RoPE and friends (0.16.1
   rotary_pos_embedding.py:162).
2. The RNG tracker: the public ``initialize_rng_tracker(inference_rng_tracker=True)`` whose
   ``fork()`` is a nullcontext (dropout is 0 here, so TP regions need no decorrelated streams).
3. ``pipeline_parallel.schedules`` builds ``torch.zeros(..., device="cuda")`` for token counts
   (0.16.1 lines 596/983/2138, 0.19.2 749/1121/2292): that module gets a torch whose ``zeros``
   maps "cuda" to the CPU.
Pipeline runs on CPU also need ``batch_p2p_comm=False`` (p2p_communication.py calls
``torch.cuda.synchronize``); `model.transformer_config` sets it.

The shims mutate process-wide state, which is why the backend runs in its own processes (the
Trainer replica, or its rank actors) and never in a sampler process.
"""

from __future__ import annotations

import os
import types
import warnings

import torch

from engine.errors import ConfigError

#: megatron-core versions this backend is written against (APIs present in both 0.16 and 0.19)
MIN_VERSION = (0, 16, 1)
MAX_VERSION_EXCLUSIVE = (0, 20, 0)
INSTALL_HINT = "pip install -e '.[megatron]' (megatron-core 0.16.1 on Python 3.11)"

_shimmed = False


def _version_tuple(v: str) -> tuple[int, ...]:
    out: list[int] = []
    for part in v.split(".")[:3]:
        digits = "".join(ch for ch in part if ch.isdigit())
        out.append(int(digits or 0))
    return tuple(out)


def require_megatron() -> str:
    """The installed megatron-core version; ConfigError with the install command if it is
    missing or outside [0.16.1, 0.20)."""
    try:
        from importlib.metadata import version

        v = version("megatron-core")
    except Exception:
        raise ConfigError(
            f"backend 'megatron' needs megatron-core, which is not installed: {INSTALL_HINT}"
        ) from None
    if not (MIN_VERSION <= _version_tuple(v) < MAX_VERSION_EXCLUSIVE):
        raise ConfigError(
            f"backend 'megatron' supports megatron-core >=0.16.1,<0.20; found {v}: {INSTALL_HINT}"
        )
    # megatron warns once per module, per process, that the optional CUDA kernels are absent:
    # expected here (we use none of them), and 12 lines per rank actor in the server log
    warnings.filterwarnings(
        "ignore", message=r".*(Transformer Engine|Apex) (and Apex )?(is|are) not installed"
    )
    return v


def on_cpu() -> bool:
    return not torch.cuda.is_available()


def apply_cpu_shims() -> None:
    """Shims 1 and 3 (module docstring); idempotent, a no-op when CUDA is available."""
    global _shimmed
    if _shimmed or not on_cpu():
        return
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]
    from megatron.core.pipeline_parallel import schedules

    class _TorchOnCpu(types.ModuleType):
        def __getattr__(self, name: str):
            return getattr(torch, name)

    shim = _TorchOnCpu("torch")

    def zeros(*args, device=None, **kwargs):
        return torch.zeros(*args, device="cpu" if device == "cuda" else device, **kwargs)

    shim.zeros = zeros  # type: ignore[attr-defined]
    schedules.torch = shim  # type: ignore[attr-defined]
    _shimmed = True


def init_parallel(
    tp: int,
    pp: int,
    *,
    rank: int = 0,
    world_size: int = 1,
    master_addr: str = "127.0.0.1",
    master_port: int | None = None,
    seed: int = 0,
) -> None:
    """The default process group (gloo on CPU, nccl on GPU) and Megatron's TP/PP groups for this
    rank. World size 1 uses an in-memory store (no port). Re-initialising with other sizes in
    the same process (tests) rebuilds the model-parallel groups."""
    import torch.distributed as dist
    from megatron.core import parallel_state, tensor_parallel

    apply_cpu_shims()
    if tp * pp != world_size:
        raise ConfigError(
            f"megatron: tensor_parallel {tp} x pipeline_parallel {pp} must equal the "
            f"{world_size} ranks of the replica"
        )
    backend = "gloo" if on_cpu() else "nccl"
    if dist.is_initialized():
        if dist.get_world_size() != world_size:
            raise RuntimeError(
                f"this process already belongs to a group of {dist.get_world_size()} ranks"
            )
    elif world_size == 1:
        from torch.distributed import HashStore  # pyright: ignore[reportPrivateImportUsage]

        dist.init_process_group(backend, store=HashStore(), rank=0, world_size=1)
    else:
        if master_port is None:
            raise ValueError("init_parallel: master_port is required for world_size > 1")
        os.environ["MASTER_ADDR"] = master_addr
        os.environ["MASTER_PORT"] = str(master_port)
        if not on_cpu():
            torch.cuda.set_device(
                int(os.environ.get("LOCAL_RANK", rank % torch.cuda.device_count()))
            )
        dist.init_process_group(backend, rank=rank, world_size=world_size)
    if parallel_state.model_parallel_is_initialized():
        if (
            parallel_state.get_tensor_model_parallel_world_size() == tp
            and parallel_state.get_pipeline_model_parallel_world_size() == pp
        ):
            return
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp
    )
    if on_cpu():
        tensor_parallel.random.initialize_rng_tracker(inference_rng_tracker=True)
    else:
        tensor_parallel.model_parallel_cuda_manual_seed(seed)
