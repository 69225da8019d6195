"""The gateway's Tinker surface, requests and futures (real in-process Trainer/Sampler on the tiny
model, real SQLite): request ids, X-Idempotency-Key replay, seq_id conflicts, future expiry (410),
allow_metadata_only, session expiry releasing adapters. Short timeouts make expiry testable in
seconds."""

from __future__ import annotations

import time

import pytest

from tests.gateway.tinker_rest import (
    fwdbwd_body,
    model,
    post_fb,
    result,
    session,
    tinker_env,
)


@pytest.fixture(scope="module")
def env(make_gateway):
    """Default timeouts: nothing expires while a test runs."""
    return tinker_env(make_gateway)


@pytest.fixture(scope="module")
def short_env(make_gateway):
    """Futures kept 1.5 s, sessions expire after 3 s without a heartbeat (swept every 0.3 s)."""
    return tinker_env(
        make_gateway,
        future_ttl_seconds=1.5,
        session_timeout_seconds=3.0,
        session_sweep_seconds=0.3,
    )


def test_request_id_header_on_success_and_in_error_envelope(env):
    client, _, _ = env
    ok = client.get("/api/v1/healthz")
    assert ok.status_code == 200 and len(ok.headers["x-request-id"]) >= 16
    bad = client.post("/api/v1/retrieve_future", json={"request_id": "req-nope"})
    assert bad.status_code == 404
    assert bad.json()["request_id"] == bad.headers["x-request-id"]
    assert bad.headers["x-should-retry"] == "false"
    empty = client.post(
        "/api/v1/create_model", content=b"", headers={"content-type": "application/json"}
    )
    assert empty.status_code == 400 and empty.content and empty.json()["error"]["message"]


def test_idempotency_key_replays_and_conflicts(env):
    client, _, _ = env
    h = {"X-Idempotency-Key": "stainless-python-retry-abc"}
    a = client.post("/api/v1/create_session", json={"tags": ["x"]}, headers=h)
    b = client.post("/api/v1/create_session", json={"tags": ["x"]}, headers=h)
    assert a.status_code == b.status_code == 200
    assert a.json()["session_id"] == b.json()["session_id"]
    assert b.headers["x-idempotent-replay"] == "true"
    c = client.post("/api/v1/create_session", json={"tags": ["y"]}, headers=h)
    assert c.status_code == 409 and "X-Idempotency-Key" in c.json()["error"]["message"]
    # Another caller with the same key is a different request.
    _, _, other = env
    d = client.post(
        "/api/v1/create_session", json={"tags": ["x"]}, headers={**h, "X-API-Key": other}
    )
    assert d.status_code == 200 and d.json()["session_id"] != a.json()["session_id"]


def test_reused_seq_id_same_payload_dedupes_different_payload_409(env):
    client, _, _ = env
    model_id = model(client)
    first = post_fb(client, fwdbwd_body(model_id, 1))
    again = post_fb(client, fwdbwd_body(model_id, 1))
    assert first.json()["request_id"] == again.json()["request_id"]
    clash = post_fb(client, fwdbwd_body(model_id, 1, tokens=(4, 5, 6)))
    assert clash.status_code == 409, clash.text
    assert "seq_id" in clash.json()["error"]["message"]
    opt = {"model_id": model_id, "seq_id": 2, "adam_params": {"learning_rate": 0.01}}
    r1 = client.post("/api/v1/optim_step", json=opt).json()
    r2 = client.post("/api/v1/optim_step", json={**opt, "adam_params": {"learning_rate": 0.5}})
    assert r2.status_code == 409
    assert "grad_norm" in result(client, r1)["metrics"]


def test_metadata_only_then_payload(env):
    client, _, _ = env
    model_id = model(client)
    fut = post_fb(client, fwdbwd_body(model_id, 1)).json()
    while True:
        meta = client.post(
            "/api/v1/retrieve_future",
            json={"request_id": fut["request_id"], "allow_metadata_only": True},
        ).json()
        if meta.get("type") != "try_again":
            break
    assert meta["status"] == "complete_metadata" and meta["response_payload_size"] > 0
    full = result(client, fut)
    assert len(full.content) == meta["response_payload_size"]


def test_expired_future_is_410(short_env):
    client, _, _ = short_env
    model_id = model(client)
    fut = client.post(
        "/api/v1/optim_step",
        json={"model_id": model_id, "seq_id": 1, "adam_params": {"learning_rate": 0.01}},
    ).json()
    result(client, fut)  # finishes (a user error: no gradient), then expires after 1.5 s
    time.sleep(2.0)
    session(client)  # any submit/lookup runs the expiry
    r = client.post("/api/v1/retrieve_future", json={"request_id": fut["request_id"]})
    assert r.status_code == 410, r.text
    assert "expired" in r.json()["error"]["message"]


def test_silent_session_expires_and_releases_adapters(short_env):
    client, trainer, _ = short_env
    sid = session(client)
    model_id = model(client, sid)
    assert trainer.backend.has_adapter(model_id)
    deadline = time.monotonic() + 10
    while trainer.backend.has_adapter(model_id) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not trainer.backend.has_adapter(model_id)
    hb = client.post("/api/v1/session_heartbeat", json={"session_id": sid})
    assert hb.status_code == 410 and "expired" in hb.json()["error"]["message"]
    fb = post_fb(client, fwdbwd_body(model_id, 1))
    assert fb.status_code == 410 and "create_training_client_from_state" in fb.text
    # The run is still listed (history stays), with a session marked expired.
    assert client.get(f"/api/v1/training_runs/{model_id}").status_code == 200
    assert client.get(f"/api/v1/sessions/{sid}").json()["status"] == "expired"


def test_heartbeats_keep_a_session_alive(short_env):
    client, trainer, _ = short_env
    sid = session(client)
    model_id = model(client, sid)
    for _ in range(16):  # 4.8 s > the 3 s timeout, with a heartbeat every 0.3 s
        assert client.post("/api/v1/session_heartbeat", json={"session_id": sid}).status_code == 200
        time.sleep(0.3)
    assert trainer.backend.has_adapter(model_id)
