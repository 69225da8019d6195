"""The Trainer's execution paths give the same numbers: sliced vs whole requests, fused vs
tenant-by-tenant batches."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from engine.config import ModelConfig
from engine.errors import UserInputError
from engine.protocol import AdamParams, ForwardBackwardInput, LoraSpec
from engine.trainer import Trainer
from tests.factories import random_batch


def _batch(seed: int, n: int = 6, length: int = 12) -> ForwardBackwardInput:
    return random_batch(seed, n, length, weights=(-0.5, 1.5))


def _cfg(model_dir, **kw) -> ModelConfig:
    return ModelConfig(name="twinkle/tiny-chat", path=str(model_dir), **kw)


def _train(trainer: Trainer, ids: list[str], steps: int = 3, concurrent: bool = True):
    async def one(i: int, a: str, out: list):
        for s in range(steps):
            fb = trainer.forward_backward(a, 2 * s + 1, _batch(i + 10 * s))
            opt = trainer.optim_step(a, 2 * s + 2, AdamParams(learning_rate=1e-2))
            res, _ = await asyncio.gather(fb, opt)
            out.append((res.metrics["loss:sum"], [o["logprobs"] for o in res.outputs]))

    async def main():
        outs = {a: [] for a in ids}
        for i, a in enumerate(ids):
            await trainer.create_adapter(a, LoraSpec(rank=2 ** (i + 1), seed=i), tenant=f"t{i}")
        if concurrent:
            await asyncio.gather(*(one(i, a, outs[a]) for i, a in enumerate(ids)))
        else:
            for i, a in enumerate(ids):
                await one(i, a, outs[a])
        return outs, await trainer.stats()

    return asyncio.run(main())


def _assert_same(a, b, atol=1e-5):
    for key in a:
        for (la, lpa), (lb, lpb) in zip(a[key], b[key], strict=True):
            assert la == pytest.approx(lb, abs=atol, rel=1e-6)
            for x, y in zip(lpa, lpb, strict=True):
                np.testing.assert_allclose(x, y, atol=atol, rtol=0)


def test_sliced_requests_equal_whole_requests(tiny_model_dir, tmp_path):
    whole, _ = _train(
        Trainer(_cfg(tiny_model_dir, slice_tokens=4096, execution="sequential"), str(tmp_path)),
        ["a"],
    )
    sliced, _ = _train(
        Trainer(_cfg(tiny_model_dir, slice_tokens=16, execution="sequential"), str(tmp_path)), ["a"]
    )
    _assert_same(whole, sliced)


def test_bad_datum_in_a_later_slice_fails_before_any_gradient(tiny_model_dir, tmp_path):
    tr = Trainer(_cfg(tiny_model_dir, slice_tokens=16, execution="sequential"), str(tmp_path))
    inp = _batch(0)
    inp.data[-1].tokens[0] = 10**6

    async def main():
        await tr.create_adapter("a", LoraSpec(rank=2))
        with pytest.raises(UserInputError, match="data\\[5\\]"):
            await tr.forward_backward("a", 1, inp)
        return tr.backend.has_pending_grad("a")

    assert asyncio.run(main()) is False


def test_fused_execution_equals_sequential(tiny_model_dir, tmp_path):
    ids = ["a", "b", "c"]
    # a quantum of one request per tenant, so every round has all tenants' requests ready
    seq, seq_stats = _train(
        Trainer(_cfg(tiny_model_dir, execution="sequential", slice_tokens=72), str(tmp_path)), ids
    )
    fused, stats = _train(
        Trainer(_cfg(tiny_model_dir, execution="fused", slice_tokens=72), str(tmp_path)), ids
    )
    assert seq_stats["fused_batches"] == 0
    assert stats["fused_batches"] >= 1 and stats["execution"]["mode"] == "fused"
    _assert_same(seq, fused)


def test_auto_execution_measures_and_chooses(tiny_model_dir, tmp_path):
    tr = Trainer(_cfg(tiny_model_dir, execution="auto"), str(tmp_path))
    assert tr.execution["mode"] in ("fused", "sequential")
    assert not [a for a in getattr(tr.backend, "_adapters", {}) if a.startswith("__costmodel")]


def test_cost_probe_is_shaped_like_real_jobs(tiny_model_dir, tmp_path):
    # The probe must time work like the replica's real jobs (a slice of 128-token rows, several
    # adapters), not a toy batch: on the tiny model 2x(2x64) favours fused, real batches do not.
    tr = Trainer(_cfg(tiny_model_dir, execution="sequential"), str(tmp_path))
    shape = tr._probe_shape()
    assert shape["n_adapters"] == 4 and shape["seq_len"] == 128
    assert shape["batch"] * shape["seq_len"] == min(tr.model.slice_tokens, 512)
    small = Trainer(_cfg(tiny_model_dir, execution="sequential", slice_tokens=72), str(tmp_path))
    assert small._probe_shape()["batch"] == 1


def test_the_compute_thread_builds_probes_and_trains(tiny_model_dir, tmp_path, monkeypatch):
    """Every torch op of a Trainer runs on its one compute thread, start-up included: libgomp
    keeps an OpenMP team per thread that ever ran a parallel op, and with more of its threads
    than cores it barely spins between ops (a probe on the constructing thread made the 25 M
    model's steps 17% slower)."""
    import threading

    from engine import trainer as trainer_mod
    from engine.scheduling import execution_probe

    seen: dict[str, str] = {}
    build, probe = trainer_mod.build_training_backend, execution_probe.measure_execution_costs

    def spy(name, fn):
        def wrapped(*args, **kwargs):
            seen[name] = threading.current_thread().name
            return fn(*args, **kwargs)

        return wrapped

    monkeypatch.setattr(trainer_mod, "build_training_backend", spy("build", build))
    monkeypatch.setattr(execution_probe, "measure_execution_costs", spy("probe", probe))
    t = Trainer(_cfg(tiny_model_dir, execution="auto"), str(tmp_path))
    forward = t.backend.forward_backward
    monkeypatch.setattr(t.backend, "forward_backward", spy("forward_backward", forward))
    _train(t, ["a"], steps=1)
    assert set(seen) == {"build", "probe", "forward_backward"}, seen
    assert len(set(seen.values())) == 1 and seen["build"].startswith("compute"), seen
    assert threading.current_thread().name not in seen.values()
