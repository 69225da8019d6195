"""Every public method of the tinker 0.38.0 RestClient through the unmodified SDK against
`twinkle serve`: runs (limit/offset, access scopes, by tinker path), checkpoints (per run, per
user), delete, publish/unpublish across users, TTL expiry, weights_info, copy_weights, sessions,
samplers; the PEFT export downloaded through its signed URLs and loaded with peft; `twinkle://`
paths on the raw routes."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import tinker
import torch
from tinker import types

pytestmark = pytest.mark.e2e
BASE = "twinkle/tiny-chat"
_rng = np.random.default_rng(5)
SEQS = [_rng.integers(10, 500, size=9).tolist() for _ in range(2)]
DATA = [
    types.Datum(
        model_input=types.ModelInput.from_ints(s[:-1]),
        loss_fn_inputs={"target_tokens": s[1:], "weights": [1.0] * (len(s) - 1)},
    )
    for s in SEQS
]


def _train(tc, steps: int = 2) -> None:
    for _ in range(steps):
        tc.forward_backward(DATA, "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=2e-2)).result()


@pytest.fixture(scope="module")
def owner(server):
    key = server.create_key("rest-owner")
    sc = tinker.ServiceClient(base_url=server.url, api_key=key)
    rest = tinker.RestClient(base_url=server.url, api_key=key)
    yield sc, rest, key
    sc.close("success")


@pytest.fixture(scope="module")
def stranger(server):
    key = server.create_key("rest-stranger")
    sc = tinker.ServiceClient(base_url=server.url, api_key=key)
    yield sc, tinker.RestClient(base_url=server.url, api_key=key), key
    sc.close("success")


def test_list_training_runs_paginates_and_get_by_id_or_path(owner):
    sc, rest, _ = owner
    tcs = [
        sc.create_lora_training_client(base_model=BASE, rank=4, seed=i).result() for i in range(3)
    ]
    page1 = rest.list_training_runs(limit=2, offset=0).result()
    page2 = rest.list_training_runs(limit=2, offset=2).result()
    assert page1.cursor.total_count >= 3 and len(page1.training_runs) == 2
    ids = [r.training_run_id for r in page1.training_runs + page2.training_runs]
    assert len(ids) == len(set(ids)) and {t.model_id for t in tcs} <= set(ids)
    run = rest.get_training_run(tcs[0].model_id).result()
    assert run.base_model == BASE and run.model_owner == "rest-owner" and run.lora_rank == 4
    path = tcs[0].save_state("p").result().path
    by_path = rest.get_training_run_by_tinker_path(path).result()
    assert by_path.training_run_id == tcs[0].model_id
    assert by_path.last_checkpoint.tinker_path == path
    with pytest.raises(tinker.NotFoundError):
        rest.get_training_run("sess-nope:train:0").result()


def test_checkpoint_listing_user_listing_and_delete(owner):
    sc, rest, _ = owner
    tc = sc.create_lora_training_client(base_model=BASE, rank=4).result()
    a = tc.save_state("a").result().path
    b = tc.save_weights_for_sampler("b").result().path
    listed = rest.list_checkpoints(tc.model_id).result().checkpoints
    assert [(c.checkpoint_id, c.checkpoint_type) for c in listed] == [
        ("weights/a", "training"),
        ("sampler_weights/b", "sampler"),
    ]
    assert all(c.size_bytes and c.size_bytes > 0 for c in listed)
    mine = rest.list_user_checkpoints(limit=1, offset=0).result()
    assert len(mine.checkpoints) == 1 and mine.cursor.total_count >= 2
    everything = rest.list_user_checkpoints(limit=100).result().checkpoints
    assert {a, b} <= {c.tinker_path for c in everything}
    rest.delete_checkpoint(tc.model_id, "weights/a").result()
    rest.delete_checkpoint_from_tinker_path(b).result()
    assert rest.list_checkpoints(tc.model_id).result().checkpoints == []
    with pytest.raises(tinker.NotFoundError):
        rest.delete_checkpoint_from_tinker_path(b).result()


def test_publish_unpublish_across_users(owner, stranger):
    sc, rest, _ = owner
    _, other_rest, _ = stranger
    other_sc = stranger[0]
    tc = sc.create_lora_training_client(base_model=BASE, rank=4, seed=8).result()
    _train(tc, 1)
    path = tc.save_weights_for_sampler("pub").result().path
    with pytest.raises(tinker.NotFoundError):
        other_rest.get_weights_info_by_tinker_path(path).result()
    rest.publish_checkpoint_from_tinker_path(path).result()
    assert rest.list_checkpoints(tc.model_id).result().checkpoints[0].public is True
    accessible = other_rest.list_training_runs(access_scope="accessible", limit=1000).result()
    owned = other_rest.list_training_runs(access_scope="owned", limit=1000).result()
    assert tc.model_id in [r.training_run_id for r in accessible.training_runs]
    assert tc.model_id not in [r.training_run_id for r in owned.training_runs]
    assert other_rest.get_training_run(tc.model_id, access_scope="accessible").result()
    assert other_rest.get_weights_info_by_tinker_path(path).result().base_model == BASE
    sampler = other_sc.create_sampling_client(model_path=path)
    assert (
        sampler.sample(
            types.ModelInput.from_ints(SEQS[0][:3]), 1, types.SamplingParams(max_tokens=2)
        )
        .result()
        .sequences
    )
    with pytest.raises(tinker.NotFoundError):  # public is read-only for others
        other_rest.delete_checkpoint_from_tinker_path(path).result()
    rest.unpublish_checkpoint_from_tinker_path(path).result()
    with pytest.raises(tinker.NotFoundError):
        other_rest.get_weights_info_by_tinker_path(path).result()


def test_checkpoint_ttl_expires_and_404s(owner):
    sc, rest, _ = owner
    tc = sc.create_lora_training_client(base_model=BASE, rank=4).result()
    keep = tc.save_state("keep").result().path
    gone = tc.save_state("gone").result().path
    rest.set_checkpoint_ttl_from_tinker_path(gone, 1).result()
    rest.set_checkpoint_ttl_from_tinker_path(keep, 7200).result()
    rest.set_checkpoint_ttl_from_tinker_path(keep, None).result()
    time.sleep(1.5)
    listed = rest.list_checkpoints(tc.model_id).result().checkpoints
    assert [c.tinker_path for c in listed] == [keep] and listed[0].expires_at is None
    with pytest.raises(tinker.NotFoundError):
        rest.get_weights_info_by_tinker_path(gone).result()
    with pytest.raises(tinker.NotFoundError):  # expired paths cannot be loaded either
        sc.create_training_client_from_state(gone).result()


def test_weights_info_copy_weights_and_get_sampler(owner):
    sc, rest, _ = owner
    tc = sc.create_lora_training_client(base_model=BASE, rank=8, train_unembed=False).result()
    path = tc.save_state("wi").result().path
    info = rest.get_weights_info_by_tinker_path(path).result()
    assert (info.base_model, info.is_lora, info.lora_rank, info.train_unembed) == (
        BASE,
        True,
        8,
        False,
    )
    copied = rest.copy_weights(path, "proj-x", ttl_seconds=7200).result()
    assert copied.endswith("/weights/wi") and copied != path
    assert rest.get_weights_info_by_tinker_path(copied).result().lora_rank == 8
    copy_run = rest.get_training_run_by_tinker_path(copied).result()
    assert copy_run.last_checkpoint.expires_at is not None
    in_project = rest.list_training_runs(project_id="proj-x", limit=100).result()
    assert copy_run.training_run_id in [r.training_run_id for r in in_project.training_runs]
    sampler = tc.save_weights_and_get_sampling_client().result()
    got = rest.get_sampler(sampler._sampling_session_id).result()
    assert got.sampler_id == sampler._sampling_session_id and got.base_model == BASE


def test_sessions_list_get_and_assign_project(owner):
    sc, rest, _ = owner
    tc = sc.create_lora_training_client(base_model=BASE, rank=4).result()
    session_id = sc.holder.get_session_id()
    assert session_id in rest.list_sessions(limit=100).result().sessions
    got = rest.get_session(session_id).result()
    assert tc.model_id in got.training_run_ids
    rest.assign_session_project(session_id, "proj-sessions").result()
    runs = rest.list_training_runs(project_id="proj-sessions", limit=100).result().training_runs
    assert tc.model_id in [r.training_run_id for r in runs]
    with pytest.raises(RuntimeError, match="JWT"):
        rest.whoami().result()
    assert rest.get_server_capabilities().result().supported_models[0].model_name == BASE


def test_external_weights_download_loads_in_peft_with_server_logits(server, owner, tmp_path):
    import peft  # a dev dependency (pyproject: dev): missing is a broken install, not a skip
    from transformers import AutoModelForCausalLM

    sc, rest, _ = owner
    tc = sc.create_lora_training_client(base_model=BASE, rank=4, seed=31).result()
    _train(tc, 3)
    server_out = tc.forward(DATA, "cross_entropy").result()
    path = tc.save_weights_external("peft").result().path
    urls = rest.get_external_weights_urls(path).result()
    assert set(urls.urls) == {"adapter_model.safetensors", "adapter_config.json"}
    out = tmp_path / "export"
    out.mkdir()
    for name, url in urls.urls.items():
        r = httpx.get(url, timeout=30)  # no API key: the signature is the credential
        assert r.status_code == 200, r.text
        (out / name).write_bytes(r.content)
    assert httpx.get(url.replace("sig=", "sig=0"), timeout=30).status_code == 403
    # hostile URLs (undecodable signatures, bad paths) are plain 403 / 404 / 400, never 500
    assert httpx.get(url.replace("sig=", "sig=%C3%A9%F0%9F%98%80"), timeout=30).status_code == 403
    base_url, _, query = url.partition("?")
    row_url = base_url.rsplit("/", 1)[0]
    assert httpx.get(f"{row_url}/adapter_%C3%A9.json?{query}", timeout=30).status_code == 404
    huge = row_url.rsplit("/", 1)[0] + "/" + "9" * 30
    assert httpx.get(f"{huge}/adapter_config.json?{query}", timeout=30).status_code == 404
    assert httpx.get(f"{row_url}/adapter_config.json?sig=x", timeout=30).status_code == 400
    base = AutoModelForCausalLM.from_pretrained(Path(server.data_dir) / "models" / "tiny-chat")
    model = peft.PeftModel.from_pretrained(base, str(out)).eval()
    for datum, outputs in zip(DATA, server_out.loss_fn_outputs, strict=True):
        ids = torch.tensor([datum.model_input.to_ints()])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0].float()
        targets = torch.tensor(datum.loss_fn_inputs["target_tokens"].tolist())
        lp = torch.log_softmax(logits, -1).gather(-1, targets[:, None])[:, 0]
        np.testing.assert_allclose(lp.numpy(), outputs["logprobs"].tolist(), atol=1e-5)
    # The export is a listed, deletable checkpoint; its URLs die with it.
    rest.delete_checkpoint_from_tinker_path(path).result()
    assert httpx.get(urls.urls["adapter_config.json"], timeout=30).status_code == 404


def test_twinkle_scheme_works_where_tinker_does(server, owner):
    sc, rest, key = owner
    tc = sc.create_lora_training_client(base_model=BASE, rank=4).result()
    path = tc.save_state("alias").result().path
    alias = path.replace("tinker://", "twinkle://")
    h = {"X-API-Key": key}
    api = f"{server.url}/api/v1"
    info = httpx.post(f"{api}/weights_info", json={"tinker_path": alias}, headers=h, timeout=30)
    assert info.status_code == 200 and info.json()["lora_rank"] == 4
    run = httpx.get(f"{api}/training_runs/{alias}", headers=h, timeout=30)
    assert run.status_code == 200 and run.json()["training_run_id"] == tc.model_id
    session_id = sc.holder.get_session_id()
    sampler = httpx.post(
        f"{api}/create_sampling_session",
        json={"session_id": session_id, "sampling_session_seq_id": 9000, "model_path": alias},
        headers=h,
        timeout=30,
    )
    assert sampler.status_code == 200, sampler.text
    copy = httpx.post(
        f"{api}/copy_weights",
        json={"source_path": alias, "destination_project_id": "p"},
        headers=h,
        timeout=30,
    )
    assert copy.status_code == 200 and copy.json()["tinker_path"].startswith("tinker://")
    load = httpx.post(
        f"{api}/load_weights",
        json={"session_id": session_id, "model_seq_id": 9000, "path": alias, "optimizer": True},
        headers=h,
        timeout=30,
    )
    assert load.status_code == 200 and load.json()["model_id"] == f"{session_id}:train:9000"
