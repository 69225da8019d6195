"""The Megatron backend at world size 2 (two gloo processes on CPU) equals world size 1.

The same fixed multi-tenant scenario runs at world size 1 in this process and as two SPMD ranks
(`MegatronWorker` in two spawned processes): three adapters of ranks 2/4/8 (one attention-only,
one with lm_head), losses cross_entropy / ppo / dpo in one fused ``forward_backward_many`` per step,
the gradient norms, ``optim_step`` for each, three steps, then a fused forward-only pass. Cases:
TP=2 on the tied tiny model, PP=2 with small micro-batches (a 1F1B schedule over micro-batches,
some mixing adapters), TP=2 on an untied copy of the tiny model; and TP=2 through two real Ray rank
actors (`MegatronTrainingBackend`, one step). Every rank must return rank 0's results.

Compared with world 1: losses (and every metric) and grad norms 1e-5 relative, logprobs 1e-5
absolute, gradients (first and last step) and adapters after the steps 1e-5 x the adapter's
largest entry. Measured (2 CPU cores, 2026-12-04), worst over the scenario:
  TP=2 tied:   loss 1.7e-7, norm 1.0e-7, logprob 9.5e-7, grad 6.4e-7, adapter 2.0e-7
  PP=2:        loss 2.1e-7, norm 1.5e-7, logprob 9.5e-7, grad 5.8e-7, adapter 1.2e-7
  TP=2 untied: loss 6.9e-7, norm 5.3e-7, logprob 9.5e-7, grad 1.0e-6, adapter 1.8e-7
  Ray TP=2:    loss 1.1e-7, norm 8.8e-8, logprob 9.5e-7, grad 6.4e-7, adapter 1.6e-7
"""

from __future__ import annotations

import copy
import json
import os
import pickle
import shutil
import socket
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

pytest.importorskip("megatron.core")

from engine.protocol import AdamParams, LoraSpec  # noqa: E402

SPECS = {
    "r2": LoraSpec(rank=2, alpha=16.0, seed=1),
    "r4": LoraSpec(rank=4, alpha=8.0, seed=2, train_mlp=False),  # attention only
    "r8": LoraSpec(rank=8, alpha=32.0, seed=3, train_unembed=True),  # lm_head too
}
LOSSES = {"r2": "cross_entropy", "r4": "ppo", "r8": "dpo"}
# eps 1 (not Tinker's 1e-12): with a tiny eps, Adam's update is about lr * sign(g) for small
# gradient entries, so float32 rounding in an entry near 0 (any layout's, world 1's too) becomes
# an update difference of up to 2 lr; measured 1.6e-5 to 1.8e-4 x the adapter after three steps
# with eps 1e-12 or 1e-8. With eps 1 the update is Lipschitz in the gradient (bounded by lr/eps),
# so the adapters compare as tightly as the gradients do. Clipping at 50 is active (norms ~180).
ADAM = AdamParams(learning_rate=1e-2, eps=1.0, grad_clip_norm=50.0)
STEPS = 3
SPAWN_TIMEOUT_S = 240.0


# ----------------------------------------------------------------------------- the scenario


def _inputs(steps: int) -> tuple[list[list[tuple[str, Any]]], list[tuple[str, Any]], AdamParams]:
    """The training items of each step, the forward-only items (fixed seeds), the optimizer."""
    from tests.unit.test_fused_step import request

    train = []
    for step in range(steps):
        rng = np.random.default_rng(100 + step)
        train.append([(aid, request(rng, loss)) for aid, loss in LOSSES.items()])
    rng = np.random.default_rng(7)
    fwd = [(aid, request(rng, loss)) for aid, loss in LOSSES.items()]
    for _, inp in fwd:
        inp.forward_only = True
    return train, fwd, ADAM


def _scenario(be: Any, train: list, fwd: list, adam: AdamParams) -> dict[str, Any]:
    """Run the scenario on ``be`` (a MegatronWorker rank or a MegatronTrainingBackend): every
    rank makes the same calls in the same order. Returns plain data (picklable)."""
    for aid, spec in SPECS.items():
        be.create_adapter(aid, spec)
    res: dict[str, Any] = {"metrics": [], "norms": [], "optim": [], "grads": []}
    for step, items in enumerate(train):
        outs = be.forward_backward_many(copy.deepcopy(items))
        for out in outs:
            if isinstance(out, BaseException):
                raise out
        res["metrics"].append([dict(o.metrics) for o in outs])
        res["norms"].append([be.adapter_grad(aid, "norm") for aid in LOSSES])
        if step in (0, len(train) - 1):  # B only at first (B = 0 at init), then A too
            res["grads"].append({aid: be.export_adapter(aid, grad=True) for aid in LOSSES})
        res["optim"].append([dict(be.optim_step(aid, adam).metrics) for aid in LOSSES])
    outs = be.forward_backward_many(copy.deepcopy(fwd))
    for out in outs:
        if isinstance(out, BaseException):
            raise out
    res["fwd_metrics"] = [dict(o.metrics) for o in outs]
    res["logprobs"] = [[np.asarray(d["logprobs"]) for d in o.outputs] for o in outs]
    res["exports"] = {aid: be.export_adapter(aid, grad=False) for aid in LOSSES}
    return res


def _rank_main(rank: int, model_dir: str, tp: int, pp: int, port: int, mbt: int, inputs, out):
    """One spawned rank: build the worker, run the scenario, write this rank's results."""
    torch.set_num_threads(1)
    from engine.backends.megatron.worker import MegatronWorker

    worker = MegatronWorker(
        model_dir,
        tp=tp,
        pp=pp,
        rank=rank,
        master_addr="127.0.0.1",
        master_port=port,
        max_lora_rank=16,
        micro_batch_tokens=mbt,
    )
    res = _scenario(worker, *inputs)
    res["world"] = torch.distributed.get_world_size()
    Path(out, f"rank{rank}.pkl").write_bytes(pickle.dumps(res))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def _ray_main(_: int, model_dir: str, inputs, out: str) -> None:
    """A fresh process with its own local Ray: TP=2 as two rank actors, then shut down."""
    torch.set_num_threads(1)
    os.environ.pop("RAY_ADDRESS", None)
    import ray

    from engine.backends.megatron.backend import MegatronTrainingBackend

    ray.init(
        address="local",
        num_cpus=2,
        include_dashboard=False,
        logging_level="ERROR",
        log_to_driver=False,
    )
    be = None
    try:
        be = MegatronTrainingBackend(
            model_dir, tensor_parallel=2, worker_num_cpus=0.5, max_lora_rank=16
        )
        res = _scenario(be, *inputs)
        res["actors"] = len(be._actors)
        Path(out, "rank0.pkl").write_bytes(pickle.dumps(res))
    finally:
        if be is not None:
            be.close()
        ray.shutdown()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(fn, args: tuple, nprocs: int) -> None:
    """``fn(rank, *args)`` in ``nprocs`` fresh processes; a child's exception (with its
    traceback) fails the test, and so does a hang."""
    import torch.multiprocessing as mp

    ctx = mp.start_processes(fn, args=args, nprocs=nprocs, join=False, start_method="spawn")
    deadline = time.monotonic() + SPAWN_TIMEOUT_S
    while not ctx.join(timeout=2):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
            pytest.fail(f"spawned ranks did not finish within {SPAWN_TIMEOUT_S:.0f}s")


# ----------------------------------------------------------------------------- comparisons


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


def _tensors_rel(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> float:
    """Largest difference between two exports of one adapter, over its largest entry."""
    assert list(got) == list(want)  # the same PEFT names, in HF module order
    scale = max(float(np.abs(t).max()) for t in want.values())
    assert scale > 1e-4, scale  # not vacuous
    return max(float(np.abs(got[n] - t).max()) for n, t in want.items()) / scale


def _compare(got: dict, want: dict) -> dict[str, float]:
    """Worst differences of ``got`` against the world-1 results ``want``; asserts the bounds."""
    worst = dict.fromkeys(("loss", "metric", "norm", "logprob", "grad", "export"), 0.0)
    passes = zip(
        [*got["metrics"], got["fwd_metrics"]], [*want["metrics"], want["fwd_metrics"]], strict=True
    )
    for mg, mw in passes:
        for g, w in zip(mg, mw, strict=True):
            assert set(g) == set(w)
            worst["loss"] = max(worst["loss"], _rel(g["loss:sum"], w["loss:sum"]))
            for k, v in w.items():
                worst["metric"] = max(worst["metric"], abs(g[k] - v) / max(abs(v), 1.0))
    for ng, nw in zip(got["norms"], want["norms"], strict=True):
        worst["norm"] = max([worst["norm"]] + [_rel(g, w) for g, w in zip(ng, nw, strict=True)])
    for og, ow in zip(got["optim"], want["optim"], strict=True):
        for g, w in zip(og, ow, strict=True):
            assert g["step"] == w["step"]
            worst["norm"] = max(worst["norm"], _rel(g["grad_norm"], w["grad_norm"]))
    for lg, lw in zip(got["logprobs"], want["logprobs"], strict=True):
        for g, w in zip(lg, lw, strict=True):
            assert g.shape == w.shape
            worst["logprob"] = max(worst["logprob"], float(np.abs(g - w).max()))
    for gg, gw in zip(got["grads"], want["grads"], strict=True):
        for aid in LOSSES:
            worst["grad"] = max(worst["grad"], _tensors_rel(gg[aid], gw[aid]))
    for aid in LOSSES:
        worst["export"] = max(
            worst["export"], _tensors_rel(got["exports"][aid], want["exports"][aid])
        )
    print("worst differences vs world 1:", {k: f"{v:.1e}" for k, v in worst.items()})
    assert max(worst.values()) <= 1e-5, worst
    return worst


def _same_results(a: dict, b: dict) -> None:
    """Two ranks' results are identical (every rank returns rank 0's results)."""
    assert a["metrics"] == b["metrics"]
    assert a["fwd_metrics"] == b["fwd_metrics"]
    assert a["norms"] == b["norms"]
    assert a["optim"] == b["optim"]
    for lg, lw in zip(a["logprobs"], b["logprobs"], strict=True):
        for g, w in zip(lg, lw, strict=True):
            np.testing.assert_array_equal(g, w)


def _micro_batches(items: list, budget: int) -> list[list[str]]:
    """The adapters of each micro-batch the worker cuts ``items`` into (as in worker._execute)."""
    from engine.backends.train_batching import micro_batches, validate_request

    units = [
        (aid, [int(req.data[i].tokens.shape[0]) for i in u])
        for aid, inp in items
        for req in [validate_request(inp, 2048, 512)]
        for u in req.units
    ]
    return [[units[k][0] for k in mb] for mb in micro_batches([u for _, u in units], budget)]


# ----------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def untied_model_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with its own (random) lm_head instead of the tied embedding."""
    from safetensors.torch import load_file, save_file

    dst = tmp_path_factory.mktemp("models") / "tiny-untied"
    shutil.copytree(tiny_model_dir, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["tie_word_embeddings"] = False
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    state = load_file(str(dst / "model.safetensors"))
    emb = state["model.embed_tokens.weight"]
    gen = torch.Generator().manual_seed(11)
    state["lm_head.weight"] = (torch.randn(emb.shape, generator=gen) * 0.05).to(emb.dtype)
    save_file(state, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


_REFERENCE: dict[tuple[str, int], tuple[tuple, dict]] = {}


def _world1(model_dir: Path, steps: int = STEPS) -> tuple[tuple, dict]:
    """The inputs and the world-1 results (in this process; megatron's parallel state here is
    world 1 whatever other test set it up), cached per model and step count."""
    key = (str(model_dir), steps)
    if key not in _REFERENCE:
        from engine.backends.megatron.worker import MegatronWorker

        inputs = _inputs(steps)
        worker = MegatronWorker(str(model_dir), max_lora_rank=16)
        _REFERENCE[key] = (inputs, _scenario(worker, *inputs))
    return _REFERENCE[key]


# ----------------------------------------------------------------------------- tests


@pytest.mark.parametrize(
    ("model", "tp", "pp", "mbt"),
    [
        pytest.param("tied", 2, 1, 16384, id="tp2-tied"),
        pytest.param("tied", 1, 2, 64, id="pp2-microbatches"),
        pytest.param("untied", 2, 1, 16384, id="tp2-untied"),
    ],
)
def test_two_ranks_match_one(
    request: pytest.FixtureRequest, tmp_path: Path, model: str, tp: int, pp: int, mbt: int
) -> None:
    model_dir = request.getfixturevalue("tiny_model_dir" if model == "tied" else "untied_model_dir")
    inputs, want = _world1(model_dir)
    if pp > 1:  # several micro-batches, some mixing adapters: a real 1F1B schedule
        batches = [_micro_batches(items, mbt) for items in inputs[0]]
        assert all(len(b) >= 4 for b in batches), batches
        assert any(len(set(mb)) > 1 for b in batches for mb in b), batches
    _spawn(_rank_main, (str(model_dir), tp, pp, _free_port(), mbt, inputs, str(tmp_path)), 2)
    ranks = [pickle.loads((tmp_path / f"rank{r}.pkl").read_bytes()) for r in range(2)]
    assert [r["world"] for r in ranks] == [2, 2]
    _same_results(ranks[1], ranks[0])
    _compare(ranks[0], want)


def test_ray_rank_actors_match_one(tiny_model_dir: Path, tmp_path: Path) -> None:
    """`MegatronTrainingBackend(tensor_parallel=2)` through two real Ray actors (a local Ray of
    its own, in a fresh process): one fused step and a forward pass equal world 1."""
    pytest.importorskip("ray")
    inputs, want = _world1(tiny_model_dir, steps=1)
    _spawn(_ray_main, (str(tiny_model_dir), inputs, str(tmp_path)), 1)
    got = pickle.loads((tmp_path / "rank0.pkl").read_bytes())
    assert got["actors"] == 2
    _compare(got, want)
