"""Start-up cost model: sane timings, a valid choice, and no temporary adapter left behind."""

from __future__ import annotations

import math

import pytest
import torch

from engine.backends.lora import adapter_parameters, lora_layers
from engine.backends.train_transformers import TransformersTrainingBackend
from engine.protocol import LoraSpec
from engine.scheduling.execution_probe import ADAPTER_PREFIX, MIN_SPEEDUP, measure_execution_costs


@pytest.fixture(scope="module")
def backend(tiny_model_dir) -> TransformersTrainingBackend:
    return TransformersTrainingBackend(str(tiny_model_dir))


def _adapter_ids_in_model(be: TransformersTrainingBackend) -> set[str]:
    return {aid for layer in lora_layers(be.model) for aid in layer.adapters}


def test_returns_sane_numbers_and_a_choice(backend, monkeypatch):
    """The start-up cost is bounded by counted work, not wall time (a loaded host may take any
    time): one warm-up and ``repeats`` timed runs of each mode, each on ``batch`` x ``seq_len``
    tokens per adapter. The wall-clock figure (< 2 s on an idle 2-core CPU) is printed by
    benchmarks/scheduling.py."""
    calls = {"fused": 0, "sequential": 0, "tokens": 0}
    real_many, real_one = backend.forward_backward_many, backend.forward_backward

    def many(items):
        calls["fused"] += 1
        calls["tokens"] += sum(len(d.tokens) for _, inp in items for d in inp.data)
        return real_many(items)

    def one(aid, inp):
        calls["sequential"] += 1
        calls["tokens"] += sum(len(d.tokens) for d in inp.data)
        return real_one(aid, inp)

    monkeypatch.setattr(backend, "forward_backward_many", many)
    monkeypatch.setattr(backend, "forward_backward", one)
    costs = measure_execution_costs(backend, n_adapters=2, batch=2, seq_len=64, repeats=2)
    assert set(costs) == {"fused_s", "sequential_s", "fused_speedup", "choice"}
    for key in ("fused_s", "sequential_s"):
        assert isinstance(costs[key], float)
        assert 0 < costs[key] < math.inf, costs
    assert math.isclose(costs["fused_speedup"], costs["sequential_s"] / costs["fused_s"])
    assert costs["choice"] in ("fused", "sequential")
    assert (costs["choice"] == "fused") == (costs["fused_speedup"] >= MIN_SPEEDUP)
    # (1 warm-up + 2 repeats) fused calls over 2 adapters, the same work adapter by adapter
    assert calls == {"fused": 3, "sequential": 3 * 2, "tokens": 2 * 3 * 2 * 2 * 64}


def test_leaves_no_adapter_and_does_not_touch_existing_ones(backend):
    backend.create_adapter("tenant", LoraSpec(rank=4, seed=3))
    try:
        before = {
            k: p.detach().clone() for k, p in adapter_parameters(backend.model, "tenant").items()
        }
        ids_before = _adapter_ids_in_model(backend)
        measure_execution_costs(backend, n_adapters=3, batch=1, seq_len=16, repeats=1)
        assert _adapter_ids_in_model(backend) == ids_before == {"tenant"}
        assert not any(a.startswith(ADAPTER_PREFIX) for a in backend._adapters)
        assert not backend.has_pending_grad("tenant")
        after = adapter_parameters(backend.model, "tenant")
        for k, p in after.items():
            assert p.grad is None
            assert torch.equal(p, before[k])
    finally:
        backend.delete_adapter("tenant")


def test_cleans_up_on_failure(backend, monkeypatch):
    def boom(*a, **kw):
        raise RuntimeError("boom")

    monkeypatch.setattr(backend, "forward_backward", boom)
    with pytest.raises(RuntimeError, match="boom"):
        measure_execution_costs(backend, repeats=1)
    assert _adapter_ids_in_model(backend) == set()
    assert backend._adapters == {}


def test_rejects_bad_arguments(backend):
    with pytest.raises(ValueError):
        measure_execution_costs(backend, n_adapters=0)
