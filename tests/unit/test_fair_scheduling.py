"""Fairness across tenants: a tenant sending 8× larger batches does not starve a small tenant."""

from __future__ import annotations

import asyncio
import statistics
import time

import numpy as np

from engine.config import ModelConfig
from engine.protocol import AdamParams, DatumInput, ForwardBackwardInput, LoraSpec
from engine.scheduling.fair import FairScheduler
from engine.trainer import Trainer


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


def test_drr_alternates_by_tokens_not_by_requests():
    async def main():
        sched = FairScheduler(quantum=100)
        order: list[str] = []
        jobs = [sched.run("big", "mb", 100, lambda: order.append("big")) for _ in range(6)]
        jobs += [sched.run("small", "ms", 50, lambda: order.append("small")) for _ in range(6)]
        await asyncio.gather(*jobs)
        return order

    order = asyncio.run(main())
    # Both arrive idle with a burst credit of 2 quanta + 64 = 264 tokens: big runs 2 jobs (200),
    # small 5 (250); then DRR by tokens: 100 credit per round buys one big or two small jobs.
    assert "".join("B" if o == "big" else "s" for o in order) == "BBsssssBsBBB"


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

    async def run_small(tr: Trainer, latencies: list[float], think: float) -> None:
        for i in range(steps):
            t0 = time.perf_counter()
            fb = tr.forward_backward("s", 2 * i + 1, small)
            opt = tr.optim_step("s", 2 * i + 2, AdamParams(learning_rate=1e-3))
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
        tr._seq.start("s", 1)
        await run_small(tr, solo, 0.0)
        think = think_fraction * statistics.median(solo)
        tr._seq.start("s", 1)  # a fresh sequence for the contended run
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
    print(
        f"think {think_fraction:.2f}: median solo {statistics.median(solo):.4f}s "
        f"contended {statistics.median(contended):.4f}s ratio {ratio:.2f} big_steps {big_steps}"
    )
    return ratio, big_steps, solo, contended


def test_small_tenant_latency_under_8x_neighbour(tiny_model_dir):
    """The issue's bound: median step latency within 2x solo while a neighbour sends 8x batches.

    With a client gap between steps (here a quarter of a step) the small tenant is a sparse flow:
    it is served first for its whole step and waits for at most one 128-token slice of the big
    tenant. Measured 1.2-1.5 on 2 cores; without DRR and slicing it is about 9.
    """
    ratio, big_steps, solo, contended = _contended_latencies(tiny_model_dir, 12, 0.25)
    assert big_steps >= 1  # the neighbour did make progress
    assert ratio <= 2.0, (ratio, solo, contended)


def test_backlogged_small_tenant_gets_its_fair_share(tiny_model_dir):
    """A small tenant with no gap at all between steps is backlogged like the big one, so DRR
    gives each half the compute and the small step takes 2x solo by design (token fairness);
    measured 1.9-2.2. This guards the share (a starved tenant measures ~9x)."""
    ratio, big_steps, solo, contended = _contended_latencies(tiny_model_dir, 12, 0.0)
    assert big_steps >= 1
    assert ratio <= 2.6, (ratio, solo, contended)
