"""Server-side custom losses through the unmodified tinker 0.38.0 SDK against `twinkle serve`:
the server advertises ``custom_loss_server_side``, ``ServiceClient.create_custom_loss`` uploads the
traced loss, and ``forward_backward_custom(data, handle)`` runs it in ONE forward_backward. The
same handle with ``loss_id=None`` runs the SDK's client-side path (forward, local loss, a
cross-entropy surrogate): both give the same loss, metrics, logprobs and gradient (the optimizer
step's grad_norm, then equal weights), for a DPO and a PPO variant. Hostile graphs are 400s that
leave the server serving. The cookbook DPO recipe runs either way."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import tinker
import torch
import torch.nn.functional as F
from tinker import types

pytestmark = pytest.mark.e2e
BASE = "twinkle/tiny-chat"
REPO = Path(__file__).resolve().parents[2]
ADAM = types.AdamParams(learning_rate=1e-2)
_rng = np.random.default_rng(19)


def dpo_packed(logprobs, ref_logprobs, chosen_mask, rejected_mask):
    """DPO over one datum that holds a (chosen, rejected) pair (a custom loss sees one datum)."""
    pol = logprobs - ref_logprobs
    margin = 0.1 * ((pol * chosen_mask).sum() - (pol * rejected_mask).sum())
    return -F.logsigmoid(margin), {"custom/margin:mean": margin.detach()}


def ppo_dual_clip(logprobs, old_logprobs, advantages):
    ratio = torch.exp(logprobs - old_logprobs)
    surrogate = torch.minimum(ratio * advantages, torch.clamp(ratio, 0.8, 1.2) * advantages)
    surrogate = torch.where(advantages < 0, torch.maximum(surrogate, 3.0 * advantages), surrogate)
    frac = ((ratio < 0.8) | (ratio > 1.2)).float().mean()
    return -surrogate.sum(), {"custom/clip_frac:mean": frac}


def _datum(n: int, kind: str) -> types.Datum:
    s = _rng.integers(10, 500, size=n + 1).tolist()
    inputs: dict = {"target_tokens": s[1:]}
    if kind == "dpo":
        chosen = np.r_[np.zeros(2), np.ones(n // 2 - 2), np.zeros(n - n // 2)]
        rejected = np.r_[np.zeros(n // 2 + 2), np.ones(n - n // 2 - 2)]
        inputs |= {
            "ref_logprobs": _rng.normal(-6.3, 0.2, n).astype(np.float32),
            "chosen_mask": chosen.astype(np.float32),
            "rejected_mask": rejected.astype(np.float32),
        }
    else:
        inputs |= {
            "old_logprobs": _rng.normal(-6.3, 0.3, n).astype(np.float32),
            "advantages": _rng.normal(0, 1, n).astype(np.float32),
        }
    lfi = {
        k: types.TensorData.from_numpy(np.asarray(v)) if k != "target_tokens" else v
        for k, v in inputs.items()
    }
    return types.Datum(model_input=types.ModelInput.from_ints(s[:-1]), loss_fn_inputs=lfi)


CASES = {
    "dpo": (dpo_packed, {"logprobs": 1, "ref_logprobs": 1, "chosen_mask": 1, "rejected_mask": 1}),
    "ppo": (ppo_dual_clip, {"logprobs": 1, "old_logprobs": 1, "advantages": 1}),
}


@pytest.fixture(scope="module")
def service(server, api_key):
    sc = tinker.ServiceClient(base_url=server.url, api_key=api_key)
    yield sc
    sc.close("success")


def _twins(service, seed: int):
    """Two training clients with the same weights: same seed, then the same CE step (B != 0)."""
    warm = [_datum(12, "ppo") for _ in range(2)]
    warm = [
        types.Datum(
            model_input=d.model_input,
            loss_fn_inputs={"target_tokens": d.loss_fn_inputs["target_tokens"]},
        )
        for d in warm
    ]
    pair = []
    for _ in range(2):
        tc = service.create_lora_training_client(base_model=BASE, rank=4, seed=seed).result()
        tc.forward_backward(warm, "cross_entropy").result()
        tc.optim_step(ADAM).result()
        pair.append(tc)
    return pair


@pytest.mark.parametrize("kind", list(CASES))
def test_server_side_equals_client_side_with_one_round_trip(service, kind) -> None:
    assert service.holder.get_client_config().custom_loss_server_side
    fn, ranks = CASES[kind]
    handle = service.create_custom_loss(fn, ranks).result()
    assert handle.loss_id and handle.loss_id.startswith(f"{service.holder.get_session_id()}:loss:")
    local = dataclasses.replace(handle, loss_id=None)  # the SDK's client-side path, same graph
    data = [_datum(n, kind) for n in (16, 23, 9, 30)]
    server_tc, client_tc = _twins(service, seed=40 + len(kind))
    timings = {}
    outs = {}
    for side, tc, h in (("server", server_tc, handle), ("client", client_tc, local)):
        before = tc._request_id_counter
        start = time.perf_counter()
        outs[side] = tc.forward_backward_custom(data, h).result()
        timings[side] = time.perf_counter() - start
        outs[side + "_requests"] = tc._request_id_counter - before
    assert (outs["server_requests"], outs["client_requests"]) == (1, 2)  # seq ids: one pass
    srv, cli = outs["server"], outs["client"]
    assert srv.metrics["loss:sum"] == pytest.approx(cli.metrics["loss:sum"], rel=1e-5, abs=1e-6)
    for key in cli.metrics:
        if key.startswith("custom/"):
            assert srv.metrics[key] == pytest.approx(cli.metrics[key], rel=1e-5, abs=1e-6), key
    assert "surrogate_loss:sum" in cli.metrics  # the client path's cross-entropy pass
    for a, b in zip(srv.loss_fn_outputs, cli.loss_fn_outputs, strict=True):
        np.testing.assert_allclose(a["logprobs"].tolist(), b["logprobs"].tolist(), atol=1e-5)
    norms = [tc.optim_step(ADAM).result().metrics["grad_norm"] for tc in (server_tc, client_tc)]
    assert norms[0] > 0 and norms[0] == pytest.approx(norms[1], rel=1e-5)
    after = [
        tc.forward(data, "cross_entropy").result().metrics["loss:sum"]
        for tc in (server_tc, client_tc)
    ]
    assert after[0] == pytest.approx(after[1], rel=1e-5)  # the same update
    print(
        f"\n{kind}: server-side {timings['server']:.3f} s, client-side "
        f"{timings['client']:.3f} s ({timings['client'] / timings['server']:.2f}x)"
    )


def test_hostile_graphs_are_400_naming_the_node_and_the_server_keeps_serving(server, service):
    sid = service.holder.get_session_id()
    key = service._api_key
    lp = {"ref": "logprobs"}

    def graph(*calls, out=None):
        nodes = [{"op": "placeholder", "name": "logprobs", "target": "logprobs"}]
        nodes += list(calls)
        last = calls[-1]["name"] if calls else "logprobs"
        nodes.append(
            {
                "op": "output",
                "name": "output",
                "target": "output",
                "args": [out or {"tuple": [{"ref": last}, {"dict": {}}]}],
            }
        )
        return {"format": 1, "nodes": nodes}

    def fn(name, target, *args, op="call_function"):
        return {"op": op, "name": name, "target": target, "args": list(args)}

    deep: dict = lp
    for _ in range(300):
        deep = {"tuple": [deep]}
    hostile = {
        "unknown op": (graph(fn("evil", "builtins.eval", "__import__('os')")), "node 'evil'"),
        "huge graph": (graph(*[fn(f"n{i}", "torch.exp", lp) for i in range(5000)]), "nodes"),
        "cycle": (
            graph(fn("a", "torch.exp", {"ref": "b"}), fn("b", "torch.exp", {"ref": "a"})),
            "node 'a'",
        ),
        "deep arguments": (graph(fn("d", "torch.stack", [deep])), "node 'd'"),
        "module call": (graph(fn("m", "lm_head", lp, op="call_module")), "node 'm'"),
    }
    very_deep = "[" * 100_000 + "]" * 100_000  # JSON nested beyond any parser's recursion
    r = httpx.post(
        f"{server.url}/api/v1/create_custom_loss",
        headers={"X-API-Key": key, "Content-Type": "application/json"},
        content=f'{{"graph": {very_deep}}}',
        timeout=60,
    )
    assert r.status_code == 400, r.text
    for seq, (case, (g, needle)) in enumerate(hostile.items(), start=100):
        r = httpx.post(
            f"{server.url}/api/v1/create_custom_loss",
            headers={"X-API-Key": key},
            json={
                "session_id": sid,
                "custom_loss_seq_id": seq,
                "name": "hostile",
                "inputs": [{"name": "logprobs", "rank": 1}],
                "graph": g,
            },
            timeout=60,
        )
        assert r.status_code == 400, (case, r.text)
        assert needle in r.json()["detail"], (case, r.text)

    # Wrong shapes: the graph checks out, the data does not fit it ([N] + [N + 3]): the
    # forward_backward fails as the client's error naming the node, and nothing is applied.
    def wrong(logprobs, extra):
        return (logprobs + extra).sum(), {}

    handle = service.create_custom_loss(wrong, {"logprobs": 1, "extra": 1}).result()
    tc = service.create_lora_training_client(base_model=BASE, rank=4, seed=3).result()
    bad = _datum(8, "ppo")
    bad = types.Datum(
        model_input=bad.model_input,
        loss_fn_inputs={
            "target_tokens": bad.loss_fn_inputs["target_tokens"],
            "extra": types.TensorData.from_numpy(np.zeros(11, np.float32)),
        },
    )
    with pytest.raises(tinker.RequestFailedError, match="node 'add'") as e:
        tc.forward_backward_custom([bad], handle).result()
    assert e.value.category == "user"

    # the server (and this model) go on: a normal step works
    def neg_ll(logprobs):
        return -logprobs.sum(), {}

    ok = [_datum(8, "ppo")]
    fine = service.create_custom_loss(neg_ll, {"logprobs": 1}).result()
    assert np.isfinite(tc.forward_backward_custom(ok, fine).result().metrics["loss:sum"])
    assert tc.optim_step(ADAM).result().metrics["grad_norm"] > 0
    other = tinker.ServiceClient(base_url=server.url, api_key=key)
    try:  # another session cannot use this session's loss
        ot = other.create_lora_training_client(base_model=BASE, rank=4).result()
        with pytest.raises(tinker.RequestFailedError, match="loss_id"):
            ot.forward_backward(ok, "custom", {"loss_id": fine.loss_id}).result()
    finally:
        other.close("success").result()


def _cookbook_dpo(server, key: str, mode: str) -> dict:
    env = {
        "PATH": os.environ["PATH"],
        "HOME": os.environ.get("HOME", "/root"),
        "TWINKLE_SERVER_URL": server.url,
        "TWINKLE_SERVER_TOKEN": key,
        "TINKER_TELEMETRY": "0",
        "HF_HUB_OFFLINE": "1",
    }
    script = REPO / "cookbook/client/tinker/self_host/dpo.py"
    out = subprocess.run(
        [
            sys.executable,
            str(script),
            "--max-steps",
            "3",
            "--pairs-per-step",
            "4",
            "--custom-loss",
            mode,
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_cookbook_dpo_runs_with_the_custom_loss_either_way(server) -> None:
    key = server.create_key("cookbook-custom-dpo")
    srv, cli = _cookbook_dpo(server, key, "server"), _cookbook_dpo(server, key, "client")
    assert srv["custom_loss"] == "server" and cli["custom_loss"] == "client"
    assert srv["margins"][0] == pytest.approx(0.0, abs=1e-6)  # policy == reference
    np.testing.assert_allclose(srv["losses"], cli["losses"], rtol=1e-4)
    assert srv["losses"][-1] < srv["losses"][0] and srv["margins"][-1] > 0
