"""Server-side custom losses (engine/backends/custom_loss.py) against the Tinker SDK's own
client-side path, on the tiny model: the graph the SDK traces and uploads (its ``trace_loss`` +
``encode_graph``), run by our interpreter in one forward_backward, gives the same loss, metrics,
logprobs and adapter gradient (every parameter) as the SDK's ``run_loss_handle`` on forward
logprobs followed by a cross-entropy pass with ``weights = -dLoss/dlogprobs``. Then every kind
of malformed or hostile graph is refused, naming the node and the rule."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from tinker import types as ttypes
from tinker.lib.public_interfaces.custom_loss import encode_graph, run_loss_handle, trace_loss

from engine.backends.custom_loss_graph import MAX_NODES, compile_loss
from engine.backends.custom_loss_run import CheckBudget, LossLimits, check_datum, run_loss
from engine.backends.lora import adapter_parameters
from engine.backends.train_transformers import TransformersTrainingBackend
from engine.errors import UserInputError
from engine.protocol import CustomLossGraph, DatumInput, ForwardBackwardInput, LoraSpec

AID = "a"


def dpo_packed(logprobs, ref_logprobs, chosen_mask, rejected_mask):
    """DPO on one datum holding a (chosen, rejected) pair: a per-datum loss can see one row."""
    pol = logprobs - ref_logprobs
    margin = 0.1 * ((pol * chosen_mask).sum() - (pol * rejected_mask).sum())
    loss = -F.logsigmoid(margin)
    return loss, {"custom/margin:mean": margin.detach(), "custom/acc:mean": (margin > 0).float()}


def ppo_variant(logprobs, old_logprobs, advantages, scale):
    """PPO with a dual clip and a per-datum scalar scale (a rank-0 input)."""
    ratio = torch.exp(logprobs - old_logprobs)
    clipped = torch.clamp(ratio, 0.8, 1.2)
    surrogate = torch.minimum(ratio * advantages, clipped * advantages)
    surrogate = torch.where(advantages < 0, torch.maximum(surrogate, 3.0 * advantages), surrogate)
    loss = -(surrogate.sum() * scale)
    frac = ((ratio < 0.8) | (ratio > 1.2)).float().mean()
    return loss, {"custom/clip_frac:mean": frac, "custom/tokens:sum": (advantages != 0).sum()}


DPO_RANKS = {"logprobs": 1, "ref_logprobs": 1, "chosen_mask": 1, "rejected_mask": 1}
PPO_RANKS = {"logprobs": 1, "old_logprobs": 1, "advantages": 1, "scale": 0}


@pytest.fixture(scope="module")
def be(tiny_model_dir: Path) -> TransformersTrainingBackend:
    b = TransformersTrainingBackend(str(tiny_model_dir))
    b.create_adapter(AID, LoraSpec(rank=4, alpha=8.0, seed=3))
    rng = np.random.default_rng(0)
    with torch.no_grad():  # non-zero B, so the adapter changes the logprobs
        for name, p in adapter_parameters(b.model, AID).items():
            if "lora_B" in name:
                p.copy_(torch.from_numpy(rng.normal(0.0, 0.05, tuple(p.shape))))
    return b


def _handle(fn, ranks):
    handle = trace_loss(fn, ranks, "sess")
    graph = encode_graph(handle).model_dump(mode="json")
    wire = CustomLossGraph(
        handle.name, tuple((i.name, i.rank) for i in handle.inputs), tuple(graph["nodes"])
    )
    return handle, wire


def _data(kind: str, rng) -> list[DatumInput]:
    rows = []
    for n in (7, 11, 5):
        tokens = rng.integers(0, 2000, n).tolist()
        inputs = {"target_tokens": rng.integers(0, 2000, n).astype(np.int64)}
        if kind == "dpo":
            half = n // 2
            inputs["ref_logprobs"] = rng.normal(-7.5, 0.3, n).astype(np.float32)
            inputs["chosen_mask"] = np.r_[np.ones(half), np.zeros(n - half)].astype(np.float32)
            inputs["rejected_mask"] = 1 - inputs["chosen_mask"]
        else:
            inputs["old_logprobs"] = rng.normal(-7.6, 0.2, n).astype(np.float32)
            inputs["advantages"] = rng.normal(0, 1, n).astype(np.float32)
            inputs["scale"] = np.array([rng.uniform(0.5, 2)], np.float32)
        rows.append(DatumInput(tokens, inputs))
    return rows


def _sdk_datum(d: DatumInput, names) -> ttypes.Datum:
    lfi = {}
    for k in names:
        v = d.loss_fn_inputs[k]
        lfi[k] = ttypes.TensorData.from_numpy(v.reshape(()) if k == "scale" else v)
    return ttypes.Datum(model_input=ttypes.ModelInput.from_ints(d.tokens), loss_fn_inputs=lfi)


def _grads(be) -> dict[str, torch.Tensor]:
    out = {k: p.grad.detach().clone() for k, p in adapter_parameters(be.model, AID).items()}
    be.adapter_grad(AID, "zero")
    return out


@pytest.mark.parametrize(
    ("kind", "fn", "ranks"), [("dpo", dpo_packed, DPO_RANKS), ("ppo", ppo_variant, PPO_RANKS)]
)
def test_server_side_equals_the_sdk_client_side_path(be, kind, fn, ranks) -> None:
    rng = np.random.default_rng(1)
    handle, wire = _handle(fn, ranks)
    data = _data(kind, rng)
    # server side: one pass
    server = be.forward_backward(
        AID, ForwardBackwardInput(data, "custom", {"loss_id": "x"}, custom_loss=wire)
    )
    g_server = _grads(be)
    # client side, as the SDK does it: a forward, the loss locally, then CE with -grad weights
    fwd = be.forward_backward(AID, ForwardBackwardInput(data, "cross_entropy", forward_only=True))
    lps = [torch.tensor(o["logprobs"]).requires_grad_(True) for o in fwd.outputs]
    sdk_data = [_sdk_datum(d, ["target_tokens", *handle.input_names]) for d in data]
    loss, metrics = run_loss_handle(handle, sdk_data, lps)
    loss.backward()
    weights = [
        DatumInput(
            d.tokens,
            {"target_tokens": d.loss_fn_inputs["target_tokens"], "weights": -lp.grad.numpy()},
        )
        for d, lp in zip(data, lps, strict=True)
    ]
    be.forward_backward(AID, ForwardBackwardInput(weights, "cross_entropy"))
    g_client = _grads(be)
    assert server.metrics["loss:sum"] == pytest.approx(float(loss.detach()), rel=1e-5, abs=1e-6)
    for key, value in metrics.items():
        assert server.metrics[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
    for o, lp in zip(server.outputs, lps, strict=True):
        np.testing.assert_allclose(o["logprobs"], lp.detach().numpy(), rtol=1e-5, atol=1e-6)
    assert set(g_server) == set(g_client)
    scale = max(float(g.abs().max()) for g in g_client.values())
    assert scale > 0
    for k in g_server:
        torch.testing.assert_close(g_server[k], g_client[k], rtol=1e-5, atol=1e-5 * scale)


def test_forward_only_and_sliced_requests_reduce_metrics_like_the_sdk(be) -> None:
    handle, wire = _handle(ppo_variant, PPO_RANKS)
    data = _data("ppo", np.random.default_rng(2))
    whole = be.forward_backward(
        AID,
        ForwardBackwardInput(data, "custom", {"loss_id": "x"}, forward_only=True, custom_loss=wire),
    )
    parts = [
        be.forward_backward(
            AID,
            ForwardBackwardInput(
                data[s], "custom", {"loss_id": "x"}, forward_only=True, custom_loss=wire
            ),
        )
        for s in (slice(0, 1), slice(1, 3))
    ]
    assert not be.has_pending_grad(AID)
    assert whole.metrics["loss:sum"] == pytest.approx(sum(p.metrics["loss:sum"] for p in parts))
    frac = (
        parts[0].metrics["custom/clip_frac:mean"] + 2 * parts[1].metrics["custom/clip_frac:mean"]
    ) / 3
    assert whole.metrics["custom/clip_frac:mean"] == pytest.approx(frac)
    assert whole.metrics["custom/tokens:sum"] == 7 + 11 + 5


# ----------------------------------------------------------------------------------- refusals


def _graph(*calls, output=None, inputs=(("logprobs", 1),)) -> CustomLossGraph:
    nodes = [
        {"op": "placeholder", "name": n, "target": n, "args": [], "kwargs": {}} for n, _ in inputs
    ]
    nodes += [dict({"args": [], "kwargs": {}}, **c) for c in calls]
    last = calls[-1]["name"] if calls else inputs[0][0]
    out = output if output is not None else {"tuple": [{"ref": last}, {"dict": {}}]}
    nodes.append(
        {"op": "output", "name": "output", "target": "output", "args": [out], "kwargs": {}}
    )
    return CustomLossGraph("hostile", tuple(inputs), tuple(nodes))


def _call(name, target, *args, op="call_function", **kwargs):
    return {"op": op, "name": name, "target": target, "args": list(args), "kwargs": kwargs}


LP = {"ref": "logprobs"}
REFUSED = {
    "unknown function": (_graph(_call("s", "os.system", "rm -rf /")), "node 's'"),
    "unknown method": (_graph(_call("b", "backward", LP, op="call_method")), "node 'b'"),
    "in-place method": (_graph(_call("a", "add_", LP, 1.0, op="call_method")), "node 'a'"),
    "module call": (_graph(_call("m", "linear", LP, op="call_module")), "node 'm'"),
    "captured tensor": (_graph(_call("w", "weight", op="get_attr")), "node 'w'"),
    "private attribute": (_graph(_call("g", "getattr", LP, "__class__")), "node 'g'"),
    "out= keyword": (_graph(_call("e", "torch.exp", LP, out=LP)), "'out'"),
    "forward reference": (
        _graph(_call("x", "torch.exp", {"ref": "y"}), _call("y", "torch.exp", LP)),
        "'y'",
    ),
    "self reference (a cycle)": (_graph(_call("x", "torch.exp", {"ref": "x"})), "cycles"),
    "duplicate name": (
        _graph(_call("x", "torch.exp", LP), _call("x", "torch.log", LP)),
        "used twice",
    ),
    "too many nodes": (
        _graph(*[_call(f"n{i}", "torch.exp", LP) for i in range(MAX_NODES)]),
        "at most",
    ),
    "deep nesting": (_graph(_call("x", "torch.stack", [[[[[[[[[[LP]]]]]]]]]])), "nested"),
    "huge integer": (_graph(_call("x", "operator.mul", LP, 10**30)), "2**53"),
    "bad metric key": (_graph(output={"tuple": [LP, {"dict": {"loss:sum": LP}}]}), "custom/<name>"),
    "output not (loss, metrics)": (_graph(output=LP), "(loss, metrics)"),
    "unknown encoding": (_graph(_call("x", "torch.exp", {"code": "import os"})), "'code'"),
    "bad dtype": (_graph(_call("x", "to", LP, {"dtype": "object"}, op="call_method")), "dtype"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_malformed_or_hostile_graphs_are_refused_naming_the_node(case) -> None:
    graph, needle = REFUSED[case]
    with pytest.raises(UserInputError, match="custom loss 'hostile'") as e:
        compile_loss(graph)
    assert needle in str(e.value)


def _run(be, graph, data) -> None:
    be.forward_backward(
        AID, ForwardBackwardInput(data, "custom", {"loss_id": "x"}, custom_loss=graph)
    )


def _row(x: np.ndarray) -> DatumInput:
    return DatumInput([1, 2, 3], {"target_tokens": np.array([4, 5, 6]), "x": x})


def test_run_time_refusals_name_the_datum_and_node_and_change_nothing(be) -> None:
    two = (("logprobs", 1), ("x", 1))
    small, big = np.ones(5, np.float32), np.ones(5000, np.float32)
    sum_ = _call("s", "sum", {"ref": "bad"}, op="call_method")
    cases = {
        # [3] + [5]: a shape error, found by the dry run before any compute
        "wrong shapes": (
            _graph(_call("bad", "operator.add", LP, {"ref": "x"}), sum_, inputs=two),
            small,
            "data[0]: node 'bad'",
        ),
        # [5000, 1] * [1, 5000]: 25 M elements, refused before anything is allocated
        "memory bomb": (
            _graph(
                _call("u", "reshape", {"ref": "x"}, -1, 1, op="call_method"),
                _call("v", "reshape", {"ref": "x"}, 1, -1, op="call_method"),
                _call("bad", "operator.mul", {"ref": "u"}, {"ref": "v"}),
                sum_,
                inputs=two,
            ),
            big,
            "node 'bad'",
        ),
        "string repetition": (
            _graph(_call("bad", "operator.mul", "a", 10**9), sum_, inputs=two),
            small,
            "node 'bad'",
        ),
        "loss not a scalar": (_graph(_call("e", "torch.exp", LP), inputs=two), small, "scalar"),
        "missing input": (
            _graph(
                _call("s", "sum", {"ref": "y"}, op="call_method"),
                inputs=(("logprobs", 1), ("y", 1)),
            ),
            small,
            "data[0].loss_fn_inputs.y",
        ),
        "wrong rank": (
            _graph(
                _call("s", "sum", {"ref": "x"}, op="call_method"),
                inputs=(("logprobs", 1), ("x", 2)),
            ),
            small,
            "rank 1",
        ),
    }
    before = {k: p.detach().clone() for k, p in adapter_parameters(be.model, AID).items()}
    for case, (graph, x, needle) in cases.items():
        with pytest.raises(UserInputError) as e:
            _run(be, graph, [_row(x)])
        assert needle in str(e.value), (case, str(e.value))
        assert not be.has_pending_grad(AID), case
    for k, p in adapter_parameters(be.model, AID).items():
        assert torch.equal(p, before[k])


def test_a_loss_handle_traced_by_the_sdk_compiles_with_every_op_it_records() -> None:
    def many(logprobs, x):
        n = logprobs.shape[0]
        y = logprobs[1:].softmax(-1).log().sum(dim=0, keepdim=False) / n
        z = torch.where(x > 0, logprobs, torch.zeros_like(logprobs)).mean()
        w = x.to(torch.float32).abs().sqrt().max() + F.softplus(logprobs).sum()
        return y + z + w + logprobs.clamp(min=-5.0).logsumexp(0), {}

    handle, wire = _handle(many, {"logprobs": 1, "x": 1})
    compiled = compile_loss(wire)
    lp = torch.randn(6)
    x = torch.randn(6)
    limits = LossLimits()
    shapes = [((6,), torch.float32), ((6,), torch.float32)]
    bound = check_datum(compiled, shapes, "data[0]", CheckBudget(limits), grad=True)
    ours, _ = run_loss(compiled, lp, [x], "data[0]", bound, limits)
    theirs, _ = handle.graph(lp, x)
    assert float(ours) == pytest.approx(float(theirs), rel=1e-6)


def test_functions_the_sdk_names_where_torch_defines_them_compile() -> None:
    """``torch.norm`` is traced as ``torch.functional.norm``, with its ``out=None`` default
    recorded: it is the allowed torch.norm, and a None ``out`` writes nothing."""

    def norms(logprobs, x):
        return torch.norm(logprobs) + torch.norm(x.reshape(2, -1), p="fro"), {}

    handle, wire = _handle(norms, {"logprobs": 1, "x": 1})
    assert any(n["target"] == "torch.functional.norm" for n in wire.nodes)
    compiled = compile_loss(wire)
    lp, x = torch.randn(6), torch.randn(6)
    limits = LossLimits()
    shapes = [((6,), torch.float32), ((6,), torch.float32)]
    bound = check_datum(compiled, shapes, "data[0]", CheckBudget(limits), grad=True)
    ours, _ = run_loss(compiled, lp, [x], "data[0]", bound, limits)
    theirs, _ = handle.graph(lp, x)
    assert float(ours) == pytest.approx(float(theirs), rel=1e-6)
