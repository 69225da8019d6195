"""Scheduling figures in wall-clock time (moved out of the test suite: a loaded host changes
them; tests/unit/test_fair_scheduling.py and test_execution_probe.py check the mechanisms on
counted work instead).

    .venv/bin/python benchmarks/scheduling.py            # 12 steps per run
    .venv/bin/python benchmarks/scheduling.py --steps 20

Prints a table:

* fair scheduling: median step latency of a small tenant (8 x 32 tokens) next to a tenant with 8x
  larger batches, relative to solo; with a client pause of a quarter step ("sparse") and none
  ("backlogged"). Measured on an idle 2-core CPU: 1.2-1.5 sparse (the issue's bound: <= 2),
  1.9-2.2 backlogged (2 by design: token fairness); a starved tenant measures ~9.
* execution probe: wall time of `measure_execution_costs` (the start-up choice between fused and
  sequential execution); < 2 s on an idle 2-core CPU, budgeted "under ~10 s".
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from engine.config import ModelConfig  # noqa: E402
from engine.protocol import AdamParams, DatumInput, ForwardBackwardInput, LoraSpec  # noqa: E402
from engine.trainer import Trainer  # noqa: E402


def _batch(rng, n: int, length: int) -> ForwardBackwardInput:
    data = []
    for _ in range(n):
        toks = rng.integers(5, 1500, size=length + 1)
        data.append(
            DatumInput(
                tokens=toks[:-1].tolist(),
                loss_fn_inputs={
                    "target_tokens": toks[1:].astype(np.int64),
                    "weights": np.ones(length, np.float32),
                },
            )
        )
    return ForwardBackwardInput(data=data)


def _contended_latencies(tiny_model_dir, steps: int, think_fraction: float):
    """Median small-tenant step latency solo and next to a tenant with 8x larger batches.

    A step is forward_backward + optim_step submitted together (as the SDK pipelines them),
    timed from submission until both results are back. Between steps the small tenant's client
    "thinks" for ``think_fraction`` of its solo step (data loading, the HTTP round trips of
    retrieve_future): a real client is never backlogged without a gap.
    """
    rng = np.random.default_rng(0)
    small = _batch(rng, 8, 32)  # 256 tokens
    big = _batch(rng, 64, 32)  # 8x larger: 2048 tokens
    # sequential execution: the scheduler's choices alone decide the latency (with fused
    # execution a small job rides in a batch with a big tenant's slice; `auto` picks either,
    # depending on a timing taken at start-up)
    cfg = ModelConfig(
        name="twinkle/tiny-chat",
        path=str(tiny_model_dir),
        slice_tokens=128,
        execution="sequential",
    )

    next_seq = {"s": 1}

    async def run_small(tr: Trainer, latencies: list[float], think: float) -> None:
        # seq_ids continue across the warm-up, solo and contended runs: a reused (model, seq_id)
        # is answered from the exactly-once cache without running, which would time nothing
        for _ in range(steps):
            t0 = time.perf_counter()
            seq = next_seq["s"]
            next_seq["s"] += 2
            fb = tr.forward_backward("s", seq, small)
            opt = tr.optim_step("s", seq + 1, AdamParams(learning_rate=1e-3))
            await asyncio.gather(fb, opt)
            latencies.append(time.perf_counter() - t0)
            if think:
                await asyncio.sleep(think)

    async def run_big(tr: Trainer, stop: asyncio.Event) -> int:
        i = 0
        while not stop.is_set():
            fb = tr.forward_backward("b", 2 * i + 1, big)
            opt = tr.optim_step("b", 2 * i + 2, AdamParams(learning_rate=1e-3))
            await asyncio.gather(fb, opt)
            i += 1
        return i

    async def main():
        tr = Trainer(cfg, str(tiny_model_dir.parent))
        await tr.create_adapter("s", LoraSpec(rank=4, seed=1), tenant="small")
        await tr.create_adapter("b", LoraSpec(rank=4, seed=2), tenant="big")
        warm: list[float] = []
        await run_small(tr, warm, 0.0)  # first steps allocate optimizer state, warm caches
        solo: list[float] = []
        await run_small(tr, solo, 0.0)
        think = think_fraction * statistics.median(solo)
        contended: list[float] = []
        stop = asyncio.Event()
        big_task = asyncio.create_task(run_big(tr, stop))
        await asyncio.sleep(0.05)  # the big tenant is already busy when the small one arrives
        await run_small(tr, contended, think)
        stop.set()
        big_steps = await big_task
        tr._sched.shutdown()
        return solo, contended, big_steps

    solo, contended, big_steps = asyncio.run(main())
    ratio = statistics.median(contended) / statistics.median(solo)
    return ratio, big_steps, solo, contended


def probe_seconds(model_dir: Path) -> float:
    from engine.backends.train_transformers import TransformersTrainingBackend
    from engine.scheduling.execution_probe import measure_execution_costs

    backend = TransformersTrainingBackend(str(model_dir))
    t0 = time.perf_counter()
    measure_execution_costs(backend)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=12)
    args = ap.parse_args()
    import torch

    from engine.base_models.tiny import build_tiny

    torch.set_num_threads(2)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_tiny(Path(tmp) / "models" / "tiny-chat")
        rows = []
        for name, think, bound in (("sparse", 0.25, "<= 2"), ("backlogged", 0.0, "~2")):
            ratio, big_steps, solo, contended = _contended_latencies(model_dir, args.steps, think)
            rows.append(
                (
                    f"fair scheduling, {name}",
                    f"{statistics.median(solo) * 1e3:.1f} ms solo, "
                    f"{statistics.median(contended) * 1e3:.1f} ms contended",
                    f"{ratio:.2f}x (expected {bound}; neighbour steps {big_steps})",
                )
            )
        rows.append(("execution probe", f"{probe_seconds(model_dir):.2f} s", "expected < 2 s idle"))
    width = max(len(r[0]) for r in rows)
    print(f"{'figure':<{width}}  {'measured':<40}  result")
    for r in rows:
        print(f"{r[0]:<{width}}  {r[1]:<40}  {r[2]}")


if __name__ == "__main__":
    main()
