"""A custom loss's budgets, on the real torch backend and Trainer with the tiny model: graphs built
to allocate or to spin are refused by the shape check before anything is allocated (peak RSS and
time measured), a forward-only loss holds only its live intermediates, the shape rules agree with
torch, the check never runs on the Trainer's event loop, and a loss's cost is charged as tokens.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from engine.backends.custom_loss_ops import FUNCTIONS, METHODS
from engine.backends.custom_loss_shapes import abstract_call, to_meta
from engine.backends.train_transformers import TransformersTrainingBackend
from engine.config import ModelConfig
from engine.errors import UserInputError
from engine.protocol import CustomLossGraph, DatumInput, ForwardBackwardInput, LoraSpec
from engine.scheduling.slicing import slice_input
from engine.trainer import Trainer

AID = "a"
K = 16384  # 16,384² float32 = 1 GiB


def _graph(calls, inputs=(("logprobs", 1), ("x", 1))) -> CustomLossGraph:
    nodes = [
        {"op": "placeholder", "name": n, "target": n, "args": [], "kwargs": {}} for n, _ in inputs
    ]
    for name, target, args, *kw in calls:
        op = "call_function" if "." in target else "call_method"
        nodes.append(
            {"op": op, "name": name, "target": target, "args": args, "kwargs": kw[0] if kw else {}}
        )
    out = {"tuple": [{"ref": calls[-1][0]}, {"dict": {}}]}
    nodes.append({"op": "output", "name": "output", "target": "output", "args": [out]})
    for n in nodes:
        n.setdefault("kwargs", {})
    return CustomLossGraph("attack", tuple(inputs), tuple(nodes))


def R(name: str) -> dict:
    return {"ref": name}


def _outer(n: str = "o") -> list:
    """x [N] → x[:, None] * x[None, :]: N² elements from N."""
    return [
        ("u", "reshape", [R("x"), -1, 1]),
        ("v", "reshape", [R("x"), 1, -1]),
        (n, "operator.mul", [R("u"), R("v")]),
    ]


ATTACKS = {
    # [1, K] rows picked by K indices: [K, K]; its inputs broadcast to only K elements
    "index_select K×K": (
        [
            ("r", "reshape", [R("x"), 1, -1]),
            ("i", "long", [R("x")]),
            ("y", "torch.index_select", [R("r"), 0, R("i")]),
            ("s", "sum", [R("y")]),
        ],
        np.zeros(K, np.float32),
        "node 'y' (torch.index_select): its output [16384, 16384] has 268435456 elements",
    ),
    "advanced indexing K×K": (
        [
            ("r", "reshape", [R("x"), 1, -1]),
            ("i", "long", [R("x")]),
            ("y", "operator.getitem", [R("r"), R("i")]),
            ("s", "sum", [R("y")]),
        ],
        np.zeros(K, np.float32),
        "node 'y' (operator.getitem): its output [16384, 16384]",
    ),
    "shapes that do not broadcast": (
        [("r", "reshape", [R("x"), 2, -1]), ("y", "operator.add", [R("r"), R("x")])],
        np.zeros(K, np.float32),
        "node 'y' (operator.add): shapes [2, 8192], [16384] do not broadcast",
    ),
    # an SVD of 2048²: 8.6e9 element operations (16 s on one core before the check existed)
    "nuclear norm": (
        [*_outer(), ("n", "torch.norm", [R("o")], {"p": "nuc"})],
        np.ones(2048, np.float32),
        "node 'n' (torch.norm): the loss's work reaches",
    ),
    # 40 chained 64 MiB intermediates, all kept for backward: 2.6 GiB
    "40 × 64 MiB chain": (
        [
            *_outer("o0"),
            *[(f"o{k + 1}", "operator.mul", [R(f"o{k}"), 1.0001]) for k in range(40)],
            ("s", "sum", [R("o40")]),
        ],
        np.ones(4096, np.float32),
        "node 'o16' (operator.mul): the loss's intermediates (all of which training keeps",
    ),
}


def _request(graph: CustomLossGraph, x: np.ndarray, n: int = 1, **kw) -> ForwardBackwardInput:
    row = DatumInput([1, 2, 3], {"target_tokens": np.array([4, 5, 6]), "x": x})
    return ForwardBackwardInput([row] * n, "custom", {"loss_id": "x"}, custom_loss=graph, **kw)


def _peak_rss_kib() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM"))


def _reset_peak_rss() -> None:
    with open("/proc/self/clear_refs", "w") as f:  # "5" resets VmHWM to the current RSS
        f.write("5")


@pytest.fixture(scope="module")
def be(tiny_model_dir: Path) -> TransformersTrainingBackend:
    b = TransformersTrainingBackend(str(tiny_model_dir))
    b.create_adapter(AID, LoraSpec(rank=4))
    return b


@pytest.mark.parametrize("case", list(ATTACKS))
def test_allocation_and_spin_attacks_are_refused_before_allocating(be, case) -> None:
    calls, x, needle = ATTACKS[case]
    _reset_peak_rss()
    before, t0 = _peak_rss_kib(), time.perf_counter()
    with pytest.raises(UserInputError) as e:
        be.forward_backward(AID, _request(_graph(calls), x))
    took, grew = time.perf_counter() - t0, (_peak_rss_kib() - before) / 1024
    assert f"custom loss 'attack': data[0]: {needle}" in str(e.value)
    # measured: 0.00 s, +0 to +1 MiB (before: +1,024 MiB, 16 s, +2,624 MiB for these cases)
    assert took < 1.0 and grew < 32, (took, grew)
    assert not be.has_pending_grad(AID)


def test_a_forward_only_loss_holds_only_its_live_intermediates(be) -> None:
    """12 chained 64 MiB steps, each read once: 2-3 of them alive at once (768 MiB if all were
    kept); the loss equals the chain's."""
    chain = [*_outer("o0")]
    chain += [(f"o{k + 1}", "operator.mul", [R(f"o{k}"), 1.0]) for k in range(12)]
    chain += [("s", "sum", [R("o12")])]
    x = np.ones(4096, np.float32)
    _reset_peak_rss()
    before = _peak_rss_kib()
    out = be.forward_backward(AID, _request(_graph(chain), x, forward_only=True))
    grew = (_peak_rss_kib() - before) / 1024
    assert out.metrics["loss:sum"] == pytest.approx(4096.0**2)
    assert grew < 320, grew  # measured: 137 MiB (before: 841 MiB)


def test_a_value_dependent_step_is_bounded_and_runs(be) -> None:
    """logprobs[x > 0]: checked at its largest (every entry), re-checked on the real mask."""
    calls = [
        ("m", "operator.gt", [R("x"), 0.0]),
        ("y", "operator.getitem", [R("logprobs"), R("m")]),
        ("s", "sum", [R("y")]),
    ]
    x = np.array([1.0, -1.0, 1.0], np.float32)
    fwd = be.forward_backward(AID, _request(_graph(calls), x, forward_only=True))
    lp = fwd.outputs[0]["logprobs"]
    assert fwd.metrics["loss:sum"] == pytest.approx(float(lp[0] + lp[2]), rel=1e-5)


def _meta_args(args):
    return to_meta(args)


SHAPE_CASES = [
    ("torch.exp", (torch.randn(3, 4),), {}),
    ("operator.add", (torch.randn(3, 1), torch.randn(4)), {}),
    ("operator.truediv", (torch.arange(4), 2), {}),
    ("operator.mul", (torch.arange(4), 2.5), {}),
    ("operator.gt", (torch.randn(4), 0.0), {}),
    ("operator.and_", (torch.randn(4) > 0, torch.randn(4) > 0), {}),
    ("torch.where", (torch.randn(3, 1) > 0, torch.randn(4), 0.0), {}),
    ("torch.clamp", (torch.randn(5),), {"min": -1.0, "max": 1.0}),
    ("masked_fill", (torch.randn(2, 3), torch.randn(3) > 0, 0.0), {}),
    ("torch.sum", (torch.arange(6).reshape(2, 3),), {"dim": 1, "keepdim": True}),
    ("mean", (torch.randn(2, 3, 4), (0, 2)), {}),
    ("torch.logsumexp", (torch.randn(2, 3), -1), {}),
    ("amax", (torch.randn(2, 3),), {"dim": 0}),
    ("prod", (torch.arange(1, 7),), {}),
    ("torch.cumsum", (torch.arange(6), 0), {}),
    ("softmax", (torch.randn(2, 3), -1), {}),
    ("torch.nn.functional.mse_loss", (torch.randn(3), torch.randn(3)), {}),
    ("torch.nn.functional.kl_div", (torch.randn(3), torch.randn(3)), {"reduction": "none"}),
    ("torch._C._nn.log_sigmoid", (torch.randn(3),), {}),
    ("torch.zeros_like", (torch.randn(3),), {"dtype": torch.int64}),
    ("torch.gather", (torch.randn(3, 4), 1, torch.zeros(3, 2, dtype=torch.int64)), {}),
    ("topk", (torch.randn(8), 3), {}),
    ("torch.stack", ([torch.randn(3), torch.randn(3)],), {}),
    ("operator.getitem", (torch.randn(4, 5), (slice(1, 3), None)), {}),
    ("float", (torch.arange(3),), {}),
]


@pytest.mark.parametrize("target,args,kwargs", SHAPE_CASES, ids=[c[0] for c in SHAPE_CASES])
def test_shape_rules_agree_with_torch(target, args, kwargs) -> None:
    fn = FUNCTIONS.get(target) or METHODS[target]
    real = fn(*args, **kwargs)
    meta, dependent = abstract_call(target, fn, _meta_args(args), _meta_args(kwargs))
    reals = real if isinstance(real, tuple) else (real,)
    metas = meta if isinstance(meta, tuple) else (meta,)
    assert not dependent
    for r, m in zip(reals, metas, strict=True):
        assert (tuple(r.shape), r.dtype) == (tuple(m.shape), m.dtype), target


def test_a_loss_is_charged_and_sliced_by_its_cost(be) -> None:
    """A 1-token datum whose loss does 2048² work costs ~2,000 tokens: such datums are sliced
    one per slice, though their tokens would fit one slice."""
    calls = [*_outer(), ("s", "sum", [R("o")])]
    inp = _request(_graph(calls), np.ones(2048, np.float32), n=4)
    extra = be.validate_input(inp)
    # it writes 2048² elements and reads them again: 2 × 2048² / 4096 tokens
    assert extra is not None and all(e >= 2 * 2048**2 // 4096 for e in extra), extra
    assert len(slice_input(inp, 1024, extra)) == 4
    assert len(slice_input(inp, 1024)) == 1


def test_a_tenants_custom_loss_check_never_blocks_the_event_loop(tiny_model_dir, tmp_path):
    """While one tenant's large custom-loss request (sliced: over slice_tokens) is checked and
    refused, another tenant's 3-token forward runs and the event loop keeps turning."""
    cfg = ModelConfig(
        name="twinkle/tiny-chat", path=str(tiny_model_dir), slice_tokens=16, execution="fused"
    )
    tr = Trainer(cfg, str(tmp_path))
    # an SVD of 1280² per datum (2.1e9 element operations), which the dry run on the event loop
    # once computed
    heavy = _request(
        _graph([*_outer(), ("n", "torch.norm", [R("o")], {"p": "nuc"})]),
        np.random.default_rng(0).normal(size=1280).astype(np.float32),
        n=8,
    )
    small = ForwardBackwardInput(
        [DatumInput([1, 2, 3], {"target_tokens": np.array([4, 5, 6])})],
        "cross_entropy",
        forward_only=True,
    )

    async def main():
        await tr.create_adapter("attacker", LoraSpec(rank=2), tenant="t1")
        await tr.create_adapter("victim", LoraSpec(rank=2), tenant="t2")
        gaps, stop = [], asyncio.Event()

        async def ticker():
            last = time.perf_counter()
            while not stop.is_set():
                await asyncio.sleep(0.01)
                now = time.perf_counter()
                gaps.append(now - last)
                last = now

        async def victim():
            await asyncio.sleep(0.05)  # the attacker's request is in first
            t0 = time.perf_counter()
            await tr.forward_backward("victim", 1, small)
            return time.perf_counter() - t0

        tick = asyncio.create_task(ticker())
        attack = tr.forward_backward("attacker", 1, heavy)
        res = await asyncio.gather(attack, victim(), return_exceptions=True)
        stop.set()
        await tick
        return res, max(gaps)

    (attacked, took), worst_gap = asyncio.run(main())
    assert isinstance(attacked, UserInputError) and "node 'n'" in str(attacked)
    # measured: 0.02 s and gaps of 0.016 s (before: 4.4 s, and an 11.7 s gap in the loop)
    assert took < 2.0 and worst_gap < 0.5, (took, worst_gap)
