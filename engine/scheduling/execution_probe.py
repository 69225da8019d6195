"""Start-up measurement: is a fused multi-adapter pass faster than adapters one by one here?

Owns `measure_execution_costs`, which `execution: auto` (engine/config) uses to choose
between running several adapters' ready work as one fused batch (`forward_backward_many`) or one
adapter after another (`forward_backward` each). The answer depends on the device: on a small CPU
the fused batch is usually no faster (the GEMMs are already compute-bound, and the per-segment LoRA
slicing adds work), on a GPU one large batch can fill the device where small ones cannot
(benchmarks/README.md has the numbers). The measurement uses temporary adapters on synthetic data
and leaves the backend as it found it. `probe_shape` sizes the probe like a replica's real work,
and `stored_or_measured` reuses an answer stored for the same kind of host
(engine/scheduling/probe_cache.py).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from pathlib import Path

import numpy as np

from engine.backends.base import TrainingBackend
from engine.config import ModelConfig
from engine.errors import EngineError
from engine.protocol import DatumInput, ForwardBackwardInput, LoraSpec
from engine.scheduling.probe_cache import ProbeCache

#: prefix of the temporary adapters' ids (never a client's: clients' ids are run ids)
ADAPTER_PREFIX = "__costmodel-"
#: fused must be at least this much faster to be chosen (noise margin; ties go to sequential,
#: which has smaller peak memory and no cross-tenant failure coupling)
MIN_SPEEDUP = 1.05


def _rank(backend: TrainingBackend) -> int:
    """The largest power of two ≤ min(8, backend.max_lora_rank): a typical small adapter."""
    limit = max(1, min(8, int(backend.max_lora_rank)))
    return 1 << (limit.bit_length() - 1)


def _synthetic_request(rng: np.random.Generator, vocab: int, batch: int, seq_len: int):
    data = []
    for _ in range(batch):
        tokens = rng.integers(0, vocab, seq_len)
        data.append(
            DatumInput(
                tokens=tokens.tolist(),
                loss_fn_inputs={"target_tokens": np.roll(tokens, -1).astype(np.int64)},
            )
        )
    return ForwardBackwardInput(data=data, loss_fn="cross_entropy")


def _check(results) -> None:
    for r in results:
        if isinstance(r, EngineError):
            raise r


def measure_execution_costs(
    backend: TrainingBackend,
    *,
    n_adapters: int = 2,
    batch: int = 2,
    seq_len: int = 64,
    repeats: int = 2,
) -> dict:
    """Time one fused forward+backward of ``n_adapters`` adapters (``batch`` × ``seq_len`` tokens
    each, cross-entropy) against the same work run adapter by adapter.

    Returns ``{"fused_s", "sequential_s", "fused_speedup", "choice"}``: the best (minimum) of
    ``repeats`` timings of each mode after one untimed warm-up of each, ``sequential_s / fused_s``,
    and ``"fused"`` only if that speedup is at least `MIN_SPEEDUP`, else ``"sequential"``. The
    temporary adapters (ids starting with `ADAPTER_PREFIX`) and their gradients are deleted
    afterwards, even on error; no optimizer step is taken.
    """
    if n_adapters < 1 or batch < 1 or seq_len < 2 or repeats < 1:
        raise ValueError("measure_execution_costs: n_adapters, batch, repeats >= 1, seq_len >= 2")
    vocab = int(backend.vocab_size)
    max_pos = backend.max_positions
    if max_pos is not None and max_pos > 1:
        seq_len = min(seq_len, max_pos)
    rng = np.random.default_rng(0)
    tag = uuid.uuid4().hex[:8]
    ids = [f"{ADAPTER_PREFIX}{tag}-{i}" for i in range(n_adapters)]
    items = [(aid, _synthetic_request(rng, vocab, batch, seq_len)) for aid in ids]
    created: list[str] = []
    try:
        for k, aid in enumerate(ids):
            backend.create_adapter(aid, LoraSpec(rank=_rank(backend), alpha=16.0, seed=k))
            created.append(aid)
        fused_s, sequential_s = _time_both(backend, items, repeats)
    finally:
        # Deleting the adapters drops their parameters, accumulated gradients and optimizers.
        for aid in created:
            backend.delete_adapter(aid)
    speedup = sequential_s / fused_s if fused_s > 0 else float("inf")
    return {
        "fused_s": fused_s,
        "sequential_s": sequential_s,
        "fused_speedup": speedup,
        "choice": "fused" if speedup >= MIN_SPEEDUP else "sequential",
    }


def _time_both(
    backend: TrainingBackend, items: list[tuple[str, ForwardBackwardInput]], repeats: int
) -> tuple[float, float]:
    """(fused, sequential): the best of ``repeats`` timings of each, after one warm-up of each."""
    sync = backend.synchronize  # CUDA launches are asynchronous: wait before reading the clock

    def fused() -> None:
        _check(backend.forward_backward_many(items))

    def sequential() -> None:
        for aid, inp in items:
            backend.forward_backward(aid, inp)

    def timed(fn: Callable[[], None]) -> float:
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        return time.perf_counter() - t0

    fused()  # warm-up: first-call allocations, lazy init, kernel selection
    sequential()
    fused_times: list[float] = []
    seq_times: list[float] = []
    for r in range(repeats):
        # Alternate the order so a slow drift of the machine does not favour one mode.
        order = (fused, sequential) if r % 2 == 0 else (sequential, fused)
        for fn in order:
            (fused_times if fn is fused else seq_times).append(timed(fn))
    return min(fused_times), min(seq_times)


def probe_shape(model: ModelConfig, backend: TrainingBackend) -> dict:
    """Probe the cost model with work shaped like this replica's real jobs: up to 4 adapters,
    each one slice of 128-token rows (at most 512 tokens, so start-up stays under ~10 s on a
    CPU for a 25 M model). A smaller 2 x 2x64 probe picks fused on the tiny model although
    real 8x128 batches run 1.8x faster sequentially (benchmarks/README.md)."""
    seq_len = 128
    max_pos = backend.max_positions
    if max_pos is not None and max_pos > 1:
        seq_len = min(seq_len, max_pos)
    tokens = min(model.slice_tokens, 512)
    return {
        "n_adapters": max(1, min(4, model.max_loaded_adapters)),
        "batch": max(1, tokens // seq_len),
        "seq_len": seq_len,
        "repeats": 3,  # min of 3: one disturbed timing on a shared machine must not decide
    }


def stored_or_measured(backend: TrainingBackend, shape: dict, data_root: str | Path) -> dict:
    """The probe's costs for ``shape``: stored ones when this kind of host measured this model
    lately (engine/scheduling/probe_cache.py; ~15 s of a 25 M model's start-up on a CPU), else
    measured now and stored. A backend without a device fingerprint is measured every time."""
    fingerprint = backend.device_fingerprint()
    if fingerprint is None:
        return measure_execution_costs(backend, **shape)
    cache = ProbeCache(data_root)
    key = cache.key(fingerprint, shape)
    costs = cache.get(key)
    if costs is None:
        costs = measure_execution_costs(backend, **shape)
        cache.put(key, costs)
    return costs
