"""Request limits and a database outage at the gateway, on the real app: a
body over ``gateway.max_request_body_mb`` is a 413 before it is read (with and without a length),
more datums than ``gateway.max_datums_per_request`` are a 413 naming the limit (the seq_id
passes in order), and a
Postgres that stops answering (a TCP proxy in front of it, closed) gives 503 + retry-after, not a
500 or a hang, and service resumes when it is back."""

from __future__ import annotations

import time

import pytest
from tinker import types

from tests.e2e.fault_services import TcpProxy
from tests.gateway.harness import (
    fresh_postgres_db,
    fwdbwd,
    fwdbwd_body,
    model,
    new_key,
    post_fwdbwd,
)

ENGINE_BACKEND = "mock"  # HTTP semantics only (tests/gateway/conftest.py)


@pytest.fixture(scope="module")
def gw(make_gateway):
    return make_gateway(gateway={"max_request_body_mb": 1, "max_datums_per_request": 2})


def test_body_over_the_cap_is_413_naming_it_with_or_without_a_length(gw) -> None:
    key = gw.key("body")
    h = {"X-API-Key": key, "Content-Type": "application/x-protobuf"}
    r = gw.client.post("/api/v1/forward_backward", content=b"\0" * (1024 * 1024 + 1), headers=h)
    assert r.status_code == 413, r.text
    assert "gateway.max_request_body_mb" in r.json()["error"]["message"]
    assert r.headers["x-should-retry"] == "false"

    def chunks():
        for _ in range(3):
            yield b"\0" * (512 * 1024)

    r = gw.client.post("/api/v1/forward_backward", content=chunks(), headers=h)
    assert r.status_code == 413, r.text
    assert "gateway.max_request_body_mb" in r.text
    r = gw.client.post("/api/v1/create_session", json={}, headers={"X-API-Key": key})
    assert r.status_code == 200, r.text  # a normal request still passes


def test_too_many_datums_are_a_413_naming_the_limit_and_pass_in_order(gw) -> None:
    key = gw.key("datums")
    mid = model(gw.client, key)
    d = types.Datum(
        model_input=types.ModelInput.from_ints([1, 2, 3]),
        loss_fn_inputs={"target_tokens": [2, 3, 4], "weights": [1.0, 1.0, 1.0]},
    )
    body = fwdbwd_body(mid, 1, [d, d, d])
    r = post_fwdbwd(gw.client, key, body)
    assert r.status_code == 413, r.text
    assert "gateway.max_datums_per_request" in r.json()["error"]["message"]
    r = post_fwdbwd(gw.client, key, body)  # a retry of the seq_id: its failed future
    assert r.status_code == 200, r.text
    assert "gateway.max_datums_per_request" in str(gw.wait(r.json(), key))
    r = fwdbwd(gw.client, key, mid, 2)  # the seq order moved on
    assert r.status_code == 200
    done = gw.wait(r.json(), key)
    assert not isinstance(done, dict) or "error" not in done, done


def test_postgres_unreachable_is_503_with_retry_after_then_recovers(make_gateway, postgres_url):
    direct = fresh_postgres_db(postgres_url)
    upstream = int(direct.rsplit(":", 1)[1].split("/")[0])
    proxy = TcpProxy(upstream)
    try:
        via = direct.replace(f":{upstream}/", f":{proxy.port}/")
        env = make_gateway(db_url=via)
        key = new_key(direct, "pg-outage")
        h = {"X-API-Key": key}
        assert env.client.get("/api/v1/training_runs", headers=h).status_code == 200
        proxy.close()
        t0 = time.monotonic()
        r = env.client.get("/api/v1/training_runs", headers=h)
        assert time.monotonic() - t0 < 10
        assert r.status_code == 503, r.text
        assert r.headers["retry-after"] == "5"
        assert "database is unavailable" in r.json()["error"]["message"]
        r = env.client.post("/api/v1/create_session", json={}, headers=h)
        assert r.status_code == 503, r.text
        proxy.open()
        assert env.client.get("/api/v1/training_runs", headers=h).status_code == 200
    finally:
        proxy.close()
