"""Liveness vs readiness and the drain gate of one gateway replica (gateway/lifecycle.py), on the
real app with its in-process engine: ready when every replica answers; while draining, readiness
is 503 and liveness 200, new work is 503 with Retry-After, and retrieve_future still answers so
clients collect what they started (and the drain counts what is left to collect)."""

from __future__ import annotations

from gateway.context import services_of
from tests.gateway.harness import BASE

ENGINE_BACKEND = "mock"  # HTTP semantics only (tests/gateway/conftest.py)


def test_ready_then_draining(make_gateway):
    gw = make_gateway(drain_retry_after_seconds=9)
    key = gw.key("alice")
    auth = {"X-API-Key": key}
    assert gw.client.get("/api/v1/livez").status_code == 200
    assert gw.client.get("/api/v1/readyz").json() == {"status": "ready"}
    sess = gw.client.post(
        "/api/v1/create_session", headers=auth, json={"tags": [], "sdk_version": "0.38.0"}
    )
    assert sess.status_code == 200, sess.text
    fut = gw.client.post(
        "/api/v1/create_model",
        headers=auth,
        json={
            "session_id": sess.json()["session_id"],
            "model_seq_id": 0,
            "base_model": BASE,
            "lora_config": {"rank": 4},
        },
    ).json()

    services_of(gw.app).drain.start()
    ready = gw.client.get("/api/v1/readyz")
    assert ready.status_code == 503 and ready.json()["status"] == "draining"
    assert gw.client.get("/api/v1/livez").status_code == 200
    new = gw.client.post(
        "/api/v1/create_session", headers=auth, json={"tags": [], "sdk_version": "0.38.0"}
    )
    assert new.status_code == 503
    assert new.headers["retry-after"] == "9"
    assert new.json()["error"]["code"] == "draining"
    assert new.headers["x-request-id"] == new.json()["request_id"]
    # the future is either still running or finished and not yet collected: `twinkle serve`
    # waits for the first, then briefly for the second
    status = services_of(gw.app).drain.status()
    assert status["pending"] + status["uncollected"] == 1, status
    # work accepted before the drain is still collected
    assert "model_id" in gw.wait(fut, key)
    assert services_of(gw.app).drain.status() == {"draining": True, "pending": 0, "uncollected": 0}
