"""Upstream Twinkle's Tinker DPO convention through the gateway (its cookbook ``tinker/dpo.py``,
SDK 0.16.x JSON wire): reference log-probs from ``forward`` with ``disable_lora``, then
``forward_backward(..., 'importance_sampling', loss_fn_config={'dpo_beta', 'dpo_sft_weight'})``
with ``loss_fn_inputs['ref_logps']`` runs as DPO (real in-process Trainer on the tiny model)."""

from __future__ import annotations

import math

import pytest

from tests.gateway.tinker_rest import model, tinker_env

JSON = {"Accept": "application/json"}


@pytest.fixture(scope="module")
def env(make_gateway):
    return tinker_env(make_gateway)


def _tensor(values, dtype: str) -> dict:
    return {"data": list(values), "dtype": dtype, "shape": [len(values)]}


def _datum(tokens: list[int], prompt: int, ref=None) -> dict:
    inputs = {
        "target_tokens": _tensor(tokens[1:] + [0], "int64"),
        "weights": _tensor(
            [0.0] * (prompt - 1) + [1.0] * (len(tokens) - prompt) + [0.0], "float32"
        ),
    }
    if ref is not None:
        inputs["ref_logps"] = _tensor(ref, "float32")
    return {
        "model_input": {"chunks": [{"type": "encoded_text", "tokens": tokens}]},
        "loss_fn_inputs": inputs,
    }


def _run(client, route: str, model_id: str, seq_id: int, body: dict) -> dict:
    key = "forward_input" if route == "forward" else "forward_backward_input"
    fut = client.post(
        f"/api/v1/{route}", json={"model_id": model_id, "seq_id": seq_id, key: body}
    ).json()
    while True:
        got = client.post("/api/v1/retrieve_future", json=fut, headers=JSON).json()
        if got.get("type") != "try_again":
            return got


def test_importance_sampling_with_dpo_keys_and_ref_logps_runs_dpo(env) -> None:
    client, _, _ = env
    model_id = model(client)
    seqs = [[5, 9, 12, 7, 30, 31], [5, 9, 12, 44, 45, 46]]  # chosen, rejected
    plain = [_datum(s, 3) for s in seqs]
    ref = _run(
        client,
        "forward",
        model_id,
        1,
        {"data": plain, "loss_fn": "cross_entropy", "loss_fn_config": {"disable_lora": True}},
    )
    ref_lp = [o["logprobs"]["data"] for o in ref["loss_fn_outputs"]]
    cfg = {"dpo_beta": 0.1, "dpo_sft_weight": 1.0}
    data = [_datum(s, 3, lp) for s, lp in zip(seqs, ref_lp, strict=True)]
    out = _run(
        client,
        "forward_backward",
        model_id,
        2,
        {"data": data, "loss_fn": "importance_sampling", "loss_fn_config": cfg},
    )
    m = out["metrics"]
    # a fresh adapter is the base model: margin 0, so upstream's DPOLoss value: log(2) (mean over
    # the pairs) + sft_weight * the chosen token mean of -log p
    weights = data[0]["loss_fn_inputs"]["weights"]["data"]
    chosen = sum(lp * w for lp, w in zip(ref_lp[0], weights, strict=True))
    assert m["dpo_margin:mean"] == pytest.approx(0.0, abs=1e-5)
    assert m["dpo_chosen_reward:mean"] == pytest.approx(0.0, abs=1e-5)
    assert m["dpo_chosen_logps:mean"] == pytest.approx(chosen, abs=1e-4)
    assert m["loss:sum"] == pytest.approx(math.log(2) - chosen / sum(weights), abs=1e-4)
    # without ref_logps the dpo_* keys are an error naming what is missing
    bad = _run(
        client,
        "forward_backward",
        model_id,
        3,
        {"data": plain, "loss_fn": "importance_sampling", "loss_fn_config": cfg},
    )
    assert bad.get("error") and "loss_fn_inputs.ref_logps" in bad["error"], bad
