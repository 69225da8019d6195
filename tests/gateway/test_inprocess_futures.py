"""The gateway with an in-process engine (real Trainer on the tiny model, real SQLite):
out-of-order seq_ids over HTTP, long-poll try_again, failed futures, idempotent retries."""

from __future__ import annotations

import threading
import time

import pytest
from tinker import types

from tests.gateway.harness import BASE, fwdbwd_body, post_fwdbwd

ENGINE_BACKEND = "mock"  # HTTP semantics only (tests/gateway/conftest.py)


@pytest.fixture(scope="module")
def app_client(make_gateway):
    gw = make_gateway()
    gw.client.headers["X-API-Key"] = gw.key("alice")
    return gw.client


def _model(client) -> str:
    sid = client.post("/api/v1/create_session", json={}).json()["session_id"]
    fut = client.post(
        "/api/v1/create_model",
        json={"session_id": sid, "model_seq_id": 0, "base_model": BASE, "lora_config": {"rank": 4}},
    )
    assert fut.status_code == 200, fut.text
    assert client.post("/api/v1/retrieve_future", json=fut.json()).json()["model_id"]
    return fut.json()["model_id"]


def _fwdbwd(client, model_id: str, seq_id: int):
    datum = types.Datum(
        model_input=types.ModelInput.from_ints([1, 2, 3]),
        loss_fn_inputs={"target_tokens": [2, 3, 4], "weights": [1.0, 1.0, 1.0]},
    )
    r = post_fwdbwd(client, None, fwdbwd_body(model_id, seq_id, [datum]))
    assert r.status_code == 200, r.text
    return r.json()["request_id"]


def test_out_of_order_request_long_polls_then_completes(app_client):
    model_id = _model(app_client)
    second = app_client.post(
        "/api/v1/optim_step",
        json={"model_id": model_id, "seq_id": 2, "adam_params": {"learning_rate": 0.01}},
    ).json()
    t0 = time.monotonic()
    pending = app_client.post("/api/v1/retrieve_future", json=second).json()
    assert pending["type"] == "try_again" and pending["queue_state"] == "active"
    assert "waiting for seq_id 1" in pending["queue_state_reason"]
    assert time.monotonic() - t0 >= 0.4  # the server held the poll (long_poll_seconds=0.5)

    first = _fwdbwd(app_client, model_id, 1)
    r1 = app_client.post("/api/v1/retrieve_future", json={"request_id": first})
    assert r1.headers["content-type"] == "application/x-protobuf"
    done = app_client.post("/api/v1/retrieve_future", json=second).json()
    assert done["metrics"]["step"] == 1.0 and done["metrics"]["grad_norm"] > 0


def test_retried_seq_id_returns_the_original_future(app_client):
    model_id = _model(app_client)
    a = _fwdbwd(app_client, model_id, 1)
    b = _fwdbwd(app_client, model_id, 1)
    assert a == b


def test_optim_step_without_gradient_is_a_user_error(app_client):
    model_id = _model(app_client)
    fut = app_client.post("/api/v1/optim_step", json={"model_id": model_id, "seq_id": 1}).json()
    res = app_client.post("/api/v1/retrieve_future", json=fut).json()
    assert res["category"] == "user" and "no gradient" in res["error"]


def test_unknown_future_is_404_json(app_client):
    r = app_client.post("/api/v1/retrieve_future", json={"request_id": "req-nope"})
    assert r.status_code == 404 and "request_id" in r.json()["detail"]


def test_bad_checkpoint_name_fails_in_order(app_client):
    model_id = _model(app_client)
    fut = app_client.post(
        "/api/v1/save_weights", json={"model_id": model_id, "seq_id": 1, "path": "../escape"}
    ).json()
    res = app_client.post("/api/v1/retrieve_future", json=fut).json()
    assert res["category"] == "user" and "path" in res["error"]
    # seq 2 still runs: the rejected seq 1 advanced the model's sequence
    nxt = _fwdbwd(app_client, model_id, 2)
    r = app_client.post("/api/v1/retrieve_future", json={"request_id": nxt})
    assert r.headers["content-type"] == "application/x-protobuf"


def test_concurrent_sessions_do_not_block_each_other(app_client):
    ids = []
    threads = [threading.Thread(target=lambda: ids.append(_model(app_client))) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len(set(ids)) == 3
