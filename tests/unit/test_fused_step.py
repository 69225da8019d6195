"""Fused multi-adapter forward_backward: equal to separate calls, isolated, fails per item."""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import pytest
import torch

from engine.backends.base import TrainingBackend
from engine.backends.lora import adapter_parameters
from engine.backends.train_transformers import TransformersTrainingBackend
from engine.errors import AdapterNotFoundError, BackendError, UserInputError
from engine.protocol import (
    AdamParams,
    CustomLossGraph,
    DatumInput,
    ForwardBackwardInput,
    ForwardBackwardOutput,
    LoraSpec,
)

RANKS = {"a2": 2, "a4": 4, "a8": 8, "a16": 16}
LOSS_OF = {"a2": "cross_entropy", "a4": "ppo", "a8": "cispo", "a16": "dpo"}


def make_backend(model_dir: Path, **kw) -> TransformersTrainingBackend:
    """Four adapters of ranks 2..16 with the same random non-zero B in every instance."""
    be = TransformersTrainingBackend(str(model_dir), **kw)
    gen = torch.Generator().manual_seed(7)
    for k, (aid, r) in enumerate(RANKS.items()):
        be.create_adapter(aid, LoraSpec(rank=r, alpha=16.0, seed=k, train_mlp=k % 2 == 0))
        with torch.no_grad():
            for name, p in adapter_parameters(be.model, aid).items():
                if "lora_B" in name:
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
    return be


def request(rng: np.random.Generator, loss: str, n_datums: int = 4) -> ForwardBackwardInput:
    data = []
    for _ in range(n_datums):
        n = int(rng.integers(4, 30))
        lfi = {
            "target_tokens": rng.integers(0, 2048, n),
            "weights": rng.normal(size=n).astype(np.float32),
            "logprobs": rng.uniform(-9.0, -6.0, n).astype(np.float32),
            "advantages": rng.normal(size=n).astype(np.float32),
        }
        if loss == "dpo":
            lfi["weights"] = (rng.random(n) < 0.6).astype(np.float32)
        data.append(DatumInput(tokens=rng.integers(0, 2048, n).tolist(), loss_fn_inputs=lfi))
    return ForwardBackwardInput(data=data, loss_fn=loss)


def grads(be, aid: str) -> dict[str, torch.Tensor | None]:
    return {
        k: None if p.grad is None else p.grad.clone()
        for k, p in adapter_parameters(be.model, aid).items()
    }


def assert_grads_close(g: dict, h: dict, what: object = None) -> None:
    """Gradients of one adapter from two float32 computations of the same rows (one fused batch vs
    one call per adapter, or micro-batches). The rows meet different padding and GEMM blockings,
    so sums are rounded in another order; an absolute bound of 1e-6 broke on another CPU (1.67e-6
    on a gradient of scale 14.9). Measured here (2026-12-03): 0 to 2.8e-7 x the largest gradient
    entry (about 1-2 float32 ulps). The bound, 2e-6 x scale, leaves a 7x margin and is still four
    orders below what a wrong or missing row does (>= 1e-2 x scale)."""
    diff = max(float((g[k] - t).abs().max()) for k, t in h.items())
    scale = max(float(t.abs().max()) for t in h.values())
    assert scale > 1e-3, (what, scale)  # not vacuous
    assert diff <= 2e-6 * scale, (what, diff, scale)


def assert_same_output(o1: ForwardBackwardOutput, o2: ForwardBackwardOutput) -> None:
    assert set(o1.metrics) == set(o2.metrics)
    for k, v in o1.metrics.items():
        assert abs(v - o2.metrics[k]) <= 1e-5 * max(1.0, abs(v)), (k, v, o2.metrics[k])
    for d1, d2 in zip(o1.outputs, o2.outputs, strict=True):
        assert set(d1) == set(d2)
        for k in d1:
            np.testing.assert_allclose(d1[k], d2[k], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("budget", [16384, 64])
def test_fused_gradients_equal_separate_calls(tiny_model_dir: Path, budget: int) -> None:
    rng = np.random.default_rng(1)
    items = [(aid, request(rng, LOSS_OF[aid])) for aid in RANKS]
    fused, alone = (
        make_backend(tiny_model_dir, max_batch_tokens=budget),
        make_backend(tiny_model_dir),
    )
    results = fused.forward_backward_many(items)
    for (aid, inp), out in zip(items, results, strict=True):
        assert isinstance(out, ForwardBackwardOutput), out
        single = alone.forward_backward(aid, inp)
        assert_same_output(out, single)
        assert fused.has_pending_grad(aid) and alone.has_pending_grad(aid)
        g_fused, g_alone = grads(fused, aid), grads(alone, aid)
        assert all(g is not None for g in g_fused.values())
        assert_grads_close(g_fused, g_alone, aid)
    # the default implementation (one call per item) gives the same results
    plain = make_backend(tiny_model_dir)
    for _item, o1, o2 in zip(
        items, results, TrainingBackend.forward_backward_many(plain, items), strict=True
    ):
        assert_same_output(o1, o2)


def test_forward_only_items_fuse_without_gradients(tiny_model_dir: Path) -> None:
    rng = np.random.default_rng(2)
    be, ref = make_backend(tiny_model_dir), make_backend(tiny_model_dir)
    items = [
        ("a2", request(rng, "cross_entropy")),
        ("a4", request(rng, "importance_sampling")),
        ("a8", request(rng, "dro")),
    ]
    items[0][1].forward_only = items[2][1].forward_only = True
    results = be.forward_backward_many(items)
    for (aid, inp), out in zip(items, results, strict=True):
        assert_same_output(out, ref.forward_backward(aid, inp))
        assert be.has_pending_grad(aid) == (not inp.forward_only)
    assert all(g is None for g in grads(be, "a2").values())
    assert all(g is None for g in grads(be, "a8").values())


def snapshot(be, aid: str) -> dict:
    st = be._adapters[aid]
    return {
        "params": {k: p.detach().clone() for k, p in st.params.items()},
        "grads": grads(be, aid),
        "optimizer": copy.deepcopy(st.optimizer.state_dict()),
        "step": st.step,
        "pending": be.has_pending_grad(aid),
    }


def assert_identical(s1: dict, s2: dict) -> None:
    assert s1["step"] == s2["step"] and s1["pending"] == s2["pending"]
    for k, v in s1["params"].items():
        assert torch.equal(v, s2["params"][k]), k
    for k, g in s1["grads"].items():
        h = s2["grads"][k]
        assert (g is None and h is None) or torch.equal(g, h), k
    o1, o2 = s1["optimizer"], s2["optimizer"]
    assert o1["param_groups"] == o2["param_groups"] and o1["state"].keys() == o2["state"].keys()
    for i, st in o1["state"].items():
        for name, t in st.items():
            assert torch.equal(t, o2["state"][i][name]), (i, name)


def test_other_adapters_untouched(tiny_model_dir: Path) -> None:
    rng = np.random.default_rng(3)
    be = make_backend(tiny_model_dir)
    adam = AdamParams(learning_rate=1e-2, weight_decay=0.1)
    for _ in range(2):  # give a2 optimizer state, then a pending gradient
        be.forward_backward("a2", request(rng, "cross_entropy"))
        be.optim_step("a2", adam)
    be.forward_backward("a2", request(rng, "cross_entropy"))
    before = {aid: snapshot(be, aid) for aid in ("a2", "a8")}
    assert before["a2"]["pending"] and before["a2"]["optimizer"]["state"]
    # fused step holding only a4's rows (and a forward_only row of a2), then single calls
    fo = request(rng, "cross_entropy")
    fo.forward_only = True
    [o1, o2] = be.forward_backward_many([("a4", request(rng, "ppo")), ("a2", fo)])
    assert isinstance(o1, ForwardBackwardOutput) and isinstance(o2, ForwardBackwardOutput)
    be.forward_backward("a4", request(rng, "cispo"))
    be.optim_step("a4", adam)
    be.forward_backward_many([("a4", request(rng, "dpo"))])
    be.optim_step("a4", adam)
    for aid, snap in before.items():
        assert_identical(snap, snapshot(be, aid))
    assert be.optim_step("a2", adam).metrics["step"] == 3.0
    assert not be.has_pending_grad("a2") and be.has_pending_grad("missing") is False


def test_bad_item_fails_alone(tiny_model_dir: Path) -> None:
    rng = np.random.default_rng(4)
    be, ref = make_backend(tiny_model_dir), make_backend(tiny_model_dir)
    items = [(aid, request(rng, LOSS_OF[aid])) for aid in ("a2", "a4", "a8")]
    items[1][1].data[2].tokens[3] = 5000
    items.append(("ghost", request(rng, "cross_entropy")))
    items.append(("a16", request(rng, "dpo", n_datums=3)))
    results = be.forward_backward_many(items)
    assert isinstance(results[1], UserInputError)
    assert "data[2].model_input: token id 5000 at position 3 is out of range" in str(results[1])
    assert isinstance(results[3], AdapterNotFoundError)
    assert isinstance(results[4], UserInputError) and "pairs" in str(results[4])
    for aid in ("a4", "a16"):
        assert not be.has_pending_grad(aid)
        assert all(g is None for g in grads(be, aid).values())
    for k in (0, 2):
        aid, inp = items[k]
        assert_same_output(results[k], ref.forward_backward(aid, inp))
        assert_grads_close(grads(be, aid), grads(ref, aid), aid)


def test_compute_failure_fails_its_pass_and_keeps_pending_gradients(tiny_model_dir: Path) -> None:
    rng = np.random.default_rng(5)
    be = make_backend(tiny_model_dir, max_batch_tokens=64)  # several micro-batches
    be.forward_backward("a2", request(rng, "cross_entropy"))
    before = {aid: snapshot(be, aid) for aid in RANKS}
    real, calls = be._logprobs, []

    def broken(rows):  # every training pass fails at its third micro-batch
        calls.append(len(rows))
        if torch.is_grad_enabled() and len(calls) >= 3:
            raise RuntimeError("simulated out of memory")
        return real(rows)

    be._logprobs = broken
    fo = request(rng, "cross_entropy")
    fo.forward_only = True
    items = [("a2", request(rng, "cross_entropy")), ("a4", request(rng, "ppo")), ("a8", fo)]
    results = be.forward_backward_many(items)
    # the fused pass failed, then each item alone: each gets its own error
    assert isinstance(results[0], BackendError) and isinstance(results[1], BackendError)
    assert results[0] is not results[1]
    assert "simulated out of memory" in str(results[0])
    assert isinstance(results[2], ForwardBackwardOutput)  # the forward_only pass ran on its own
    for aid, snap in before.items():
        assert_identical(snap, snapshot(be, aid))
    with pytest.raises(RuntimeError, match="simulated"):
        calls.clear()
        be.forward_backward("a4", request(rng, "ppo", n_datums=12))
    assert_identical(before["a4"], snapshot(be, "a4"))


def test_a_failed_fused_pass_runs_each_item_alone(tiny_model_dir: Path) -> None:
    """A failure of the fused pass alone (here its size: it fails only with rows of two
    adapters) does not fail the items: each gets the result of an unfused step."""
    rng = np.random.default_rng(6)
    be, ref = make_backend(tiny_model_dir), make_backend(tiny_model_dir)
    real = be._logprobs

    def too_big(rows):
        if len(rows) > 4:
            raise RuntimeError("simulated out of memory")
        return real(rows)

    be._logprobs = too_big
    items = [("a2", request(rng, "cross_entropy")), ("a4", request(rng, "ppo"))]
    results = be.forward_backward_many(items)
    for (aid, inp), out in zip(items, results, strict=True):
        assert isinstance(out, ForwardBackwardOutput), out
        assert_same_output(out, ref.forward_backward(aid, inp))
        assert_grads_close(grads(be, aid), grads(ref, aid), aid)


def _indexing_loss() -> CustomLossGraph:
    """sum(logprobs[(-1000 * logprobs).long()]): its shapes always fit, and an index of zeros
    (logprobs of 0) is in range, but real logprobs (about -7) index far beyond the datum."""
    ph = {"op": "placeholder", "name": "logprobs", "target": "logprobs", "args": [], "kwargs": {}}
    calls = [
        ("m", "call_function", "operator.mul", [{"ref": "logprobs"}, -1000.0]),
        ("i", "call_method", "long", [{"ref": "m"}]),
        ("g", "call_function", "operator.getitem", [{"ref": "logprobs"}, {"ref": "i"}]),
        ("s", "call_method", "sum", [{"ref": "g"}]),
    ]
    nodes = [{"op": op, "name": n, "target": t, "args": a, "kwargs": {}} for n, op, t, a in calls]
    out = {"op": "output", "name": "output", "target": "output",
           "args": [{"tuple": [{"ref": "s"}, {"dict": {}}]}], "kwargs": {}}  # fmt: skip
    return CustomLossGraph("indexer", (("logprobs", 1),), (ph, *nodes, out))


def test_one_tenants_failing_loss_does_not_fail_the_others_in_its_fused_pass(
    tiny_model_dir: Path,
) -> None:
    rng = np.random.default_rng(7)
    be, ref = make_backend(tiny_model_dir), make_backend(tiny_model_dir)
    victim = request(rng, "cross_entropy")
    n = 5
    attack = ForwardBackwardInput(
        data=[
            DatumInput(
                tokens=rng.integers(0, 2048, n).tolist(),
                loss_fn_inputs={"target_tokens": rng.integers(0, 2048, n)},
            )
        ],
        loss_fn="custom",
        loss_fn_config={"loss_id": "x"},
        custom_loss=_indexing_loss(),
    )
    before = snapshot(be, "a4")
    results = be.forward_backward_many([("a2", victim), ("a4", attack)])
    assert isinstance(results[1], UserInputError), results[1]
    assert "custom loss 'indexer': data[0]: node 'g'" in str(results[1])
    assert isinstance(results[0], ForwardBackwardOutput), results[0]
    assert_same_output(results[0], ref.forward_backward("a2", victim))
    assert_grads_close(grads(be, "a2"), grads(ref, "a2"), "a2")
    assert_identical(before, snapshot(be, "a4"))  # no half-applied gradient on the attacker's
