"""`use_megatron: true` through a real `twinkle serve`, started by the Megatron quick start
(tests/e2e/quickstart.py): the tiny model on the Megatron backend split over two tensor-parallel
Ray actors (gloo on CPU), served beside the same weights on the Transformers backend, driven by
the unmodified Tinker SDK and by the native client.

* every Tinker loss, optim_step, save_state, sampler weights and sampling: Megatron losses equal
  the Transformers backend's step by step, and the greedy samples of the two trained adapters are
  the same tokens;
* two tenants training at once on the Megatron model equal their solo runs;
* bad input fails the one request, the replica keeps training;
* the native client's SFT script (save, resume) gives the same losses on both backends, and
  upstream's own client (twinkle-kit) runs its SFT flow on the Megatron model as on Transformers.
"""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest
import tinker
from tinker import types

import twinkle_client
from tests.e2e.quickstart import TF_TWIN
from tests.twinkle_scripts import hf_data, roll, sft_script
from twinkle_client.model import MultiLoraTransformersModel as RemoteModel

pytestmark = pytest.mark.e2e
pytest.importorskip("megatron.core")

MG = "twinkle/tiny-chat"  # the built-in model, on the Megatron backend (TP=2)
TF = TF_TWIN  # the same folder on the Transformers backend
LOSSES = ["cross_entropy", "importance_sampling", "ppo", "cispo", "dro", "gspo"]


@pytest.fixture(scope="module")
def mg_server(pool, start_mg):
    return pool.get("megatron", start_mg)


@pytest.fixture(scope="module")
def key(mg_server) -> str:
    return mg_server.create_key("mg-alice")


def _rl_data(seed: int) -> list[types.Datum]:
    rng = np.random.default_rng(seed)
    out = []
    for n in (9, 6, 11):
        toks = rng.integers(5, 900, size=n + 1).tolist()
        out.append(
            types.Datum(
                model_input=types.ModelInput.from_ints(toks[:-1]),
                loss_fn_inputs={
                    "target_tokens": toks[1:],
                    "weights": rng.uniform(0.2, 1.5, n).tolist(),
                    "logprobs": (-rng.uniform(5.0, 8.0, n)).tolist(),
                    "advantages": rng.normal(0.0, 1.0, n).tolist(),
                    "sequence_ratio_mask": [0.0] * (n // 2) + [1.0] * (n - n // 2),
                },
            )
        )
    return out


def _inputs_for(loss: str, data: list[types.Datum]) -> list[types.Datum]:
    """Cross entropy takes targets and weights; the RL losses targets, logprobs, advantages (and
    gspo its sequence_ratio_mask)."""
    drop = {"logprobs", "advantages"} if loss == "cross_entropy" else {"weights"}
    if loss != "gspo":
        drop.add("sequence_ratio_mask")
    return [
        types.Datum(
            model_input=d.model_input,
            loss_fn_inputs={k: v for k, v in d.loss_fn_inputs.items() if k not in drop},
        )
        for d in data
    ]


def _every_loss(sc: tinker.ServiceClient, base: str) -> dict:
    tc = sc.create_lora_training_client(base_model=base, rank=8, seed=7)
    data = _rl_data(0)
    losses = []
    for loss in LOSSES:
        fb = tc.forward_backward(_inputs_for(loss, data), loss)
        opt = tc.optim_step(types.AdamParams(learning_rate=2e-2))
        losses.append(fb.result().metrics["loss:sum"])
        assert opt.result().metrics["grad_norm"] > 0
    state = tc.save_state("every-loss").result().path
    sampler = tc.save_weights_and_get_sampling_client()
    prompt = types.ModelInput.from_ints([5, 17, 33, 8])
    greedy = sampler.sample(
        prompt, num_samples=1, sampling_params=types.SamplingParams(max_tokens=8, temperature=0)
    ).result()
    after = tc.forward(_inputs_for("cross_entropy", data), "cross_entropy").result()
    return {
        "losses": losses,
        "state": state,
        "greedy": greedy.sequences[0].tokens,
        "after": after.metrics["loss:sum"],
        "tc": tc,
    }


def test_every_loss_save_and_sample_match_the_transformers_backend(mg_server, key):
    sc = tinker.ServiceClient(base_url=mg_server.url, api_key=key)
    mg, tf = _every_loss(sc, MG), _every_loss(sc, TF)
    np.testing.assert_allclose(mg["losses"], tf["losses"], rtol=1e-4, atol=1e-5)
    assert mg["after"] == pytest.approx(tf["after"], rel=1e-4)
    assert mg["greedy"] == tf["greedy"] and len(mg["greedy"]) >= 1
    # the saved Megatron state (with optimizer) resumes on Megatron where it left off
    resumed = sc.create_training_client_from_state_with_optimizer(mg["state"])
    assert resumed.get_info().model_data.model_name == MG
    again = resumed.forward(_inputs_for("cross_entropy", _rl_data(0)), "cross_entropy").result()
    assert again.metrics["loss:sum"] == pytest.approx(mg["after"], rel=1e-5)
    sc.close("success")


def _run(url: str, key: str, seed: int, steps: int, out: list) -> None:
    sc = tinker.ServiceClient(base_url=url, api_key=key)
    tc = sc.create_lora_training_client(base_model=MG, rank=4 if seed % 2 else 8, seed=seed)
    data = _inputs_for("cross_entropy", _rl_data(seed))
    for _ in range(steps):
        fb = tc.forward_backward(data, "cross_entropy")
        opt = tc.optim_step(types.AdamParams(learning_rate=5e-3, weight_decay=0.01))
        out.append(fb.result().metrics["loss:sum"])
        opt.result()
    sc.close("success")


def test_two_tenants_at_once_equal_their_solo_runs(mg_server):
    key_a, key_b = mg_server.create_key("mg-tenant-a"), mg_server.create_key("mg-tenant-b")
    steps = 4
    solo_a: list[float] = []
    solo_b: list[float] = []
    _run(mg_server.url, key_a, 5, steps, solo_a)
    _run(mg_server.url, key_b, 8, steps, solo_b)
    conc_a: list[float] = []
    conc_b: list[float] = []
    threads = [
        threading.Thread(target=_run, args=(mg_server.url, key_a, 5, steps, conc_a)),
        threading.Thread(target=_run, args=(mg_server.url, key_b, 8, steps, conc_b)),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert len(conc_a) == steps and len(conc_b) == steps
    np.testing.assert_allclose(conc_a, solo_a, atol=1e-5, rtol=1e-6)
    np.testing.assert_allclose(conc_b, solo_b, atol=1e-5, rtol=1e-6)
    assert solo_a != solo_b


def test_bad_input_fails_the_request_not_the_replica(mg_server, key):
    sc = tinker.ServiceClient(base_url=mg_server.url, api_key=key)
    tc = sc.create_lora_training_client(base_model=MG, rank=4, seed=3)

    def datum(tokens, targets):
        return types.Datum(
            model_input=types.ModelInput.from_ints(tokens),
            loss_fn_inputs={"target_tokens": targets, "weights": [1.0] * len(targets)},
        )

    with pytest.raises(tinker.RequestFailedError) as exc:
        tc.forward_backward([datum([1, 2, 3], [2, 3, 99999])], "cross_entropy").result()
    assert "target_tokens" in str(exc.value)
    with pytest.raises(tinker.RequestFailedError) as exc:
        tc.forward_backward([datum([1, 2, 3], [2, 3, 4])], "no_such_loss").result()
    assert "cross_entropy" in str(exc.value)
    ok = tc.forward_backward([datum([1, 2, 3], [2, 3, 4])], "cross_entropy")
    step = tc.optim_step(types.AdamParams(learning_rate=1e-3))
    assert ok.result().metrics["loss:sum"] > 0
    assert step.result().metrics["grad_norm"] > 0
    sc.close("success")


def test_native_client_sft_script_matches_the_transformers_backend(mg_server, key):
    client = twinkle_client.init_twinkle_client(mg_server.url, key)
    try:
        data = roll(hf_data(Path(mg_server.data_dir) / "models" / "tiny-chat"))
        mg = sft_script(RemoteModel, MG, data)
        tf = sft_script(RemoteModel, TF, data)
    finally:
        client.close()
    np.testing.assert_allclose(mg["losses"], tf["losses"], rtol=0, atol=1e-5)
    np.testing.assert_allclose(mg["norms"], tf["norms"], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(mg["resumed"], mg["losses"][4:], rtol=0, atol=1e-5)
    assert mg["losses"][-1] < mg["losses"][0]


def test_upstream_client_sft_flow_matches_the_transformers_backend(server, pool, start_mg):
    """Upstream Twinkle's own client (twinkle-kit 0.5.1, tests/compat) runs the SFT flow of its
    cookbook on the Megatron model exactly as on the Transformers-backed default server."""
    from tests.compat.run_upstream import run_flow
    from tests.compat.venv import CompatVenvUnavailable, compat_python

    try:
        upstream = str(compat_python())
    except CompatVenvUnavailable as exc:
        pytest.skip(str(exc))
    tf = run_flow(upstream, server.url, server.create_key("tf-upstream"), "sft")
    mg_server = pool.get("megatron", start_mg)  # one server at a time: the default one stops
    mg = run_flow(upstream, mg_server.url, mg_server.create_key("mg-upstream"), "sft")
    assert mg["models"] == [MG, TF]
    np.testing.assert_allclose(mg["losses"], tf["losses"], rtol=1e-5)
    assert mg["losses"][-1] < mg["losses"][0]
    assert mg["path"].startswith("twinkle://")
