"""The gateway's Tinker surface across SDK versions (real in-process Trainer on the tiny model,
real SQLite): deprecation headers and warnings, and the 0.16.x JSON wire format."""

from __future__ import annotations

import pytest

from gateway.middleware import deprecation_for, parse_version
from tests.gateway.tinker_rest import (
    fwdbwd_body,
    model,
    post_fb,
    result,
    tinker_env,
)


@pytest.fixture(scope="module")
def env(make_gateway):
    """Default timeouts: nothing expires while a test runs."""
    return tinker_env(make_gateway)


def test_deprecation_policy():
    assert parse_version("0.16.1") == (0, 16, 1)
    assert deprecation_for((0, 38, 0), "0.38.0", "0.16.0") is None
    level, note = deprecation_for((0, 16, 1), "0.38.0", "0.16.0")
    assert level == "warning" and "0.16.1" in note
    assert deprecation_for((0, 15, 0), "0.38.0", "0.16.0")[0] == "error"
    assert deprecation_for(None, "0.38.0", "0.16.0") is None


def test_deprecation_headers_from_sdk_user_agent(env):
    client, _, _ = env
    old = client.get("/api/v1/healthz", headers={"User-Agent": "Tinker/Python 0.16.1"})
    assert old.headers["x-deprecation-level"] == "warning"
    assert "0.16.1" in old.headers["x-deprecation-note"]
    current = client.get("/api/v1/healthz", headers={"User-Agent": "AsyncTinker/Python 0.38.0"})
    assert "x-deprecation-level" not in current.headers
    ancient = client.get(
        "/api/v1/healthz",
        headers={"User-Agent": "AsyncTinker/Python 0.3.0", "X-Stainless-Package-Version": "0.3.0"},
    )
    assert ancient.headers["x-deprecation-level"] == "error"
    plain = client.get("/api/v1/healthz", headers={"User-Agent": "curl/8"})
    assert "x-deprecation-level" not in plain.headers


def _json_datum(tokens):
    return {
        "model_input": {"chunks": [{"type": "encoded_text", "tokens": list(tokens)}]},
        "loss_fn_inputs": {
            "target_tokens": {
                "data": [t + 1 for t in tokens],
                "dtype": "int64",
                "shape": [len(tokens)],
            },
            "weights": {"data": [1.0] * len(tokens), "dtype": "float32"},
        },
    }


def test_old_sdk_json_wire_format(env):
    """SDK 0.16.x: JSON forward_backward and /forward bodies, JSON results (Accept: json)."""
    client, _, _ = env
    model_id = model(client)
    json_h = {"Accept": "application/json"}
    fb = client.post(
        "/api/v1/forward_backward",
        json={
            "model_id": model_id,
            "seq_id": 1,
            "forward_backward_input": {
                "data": [_json_datum([1, 2, 3])],
                "loss_fn": "cross_entropy",
            },
        },
    ).json()
    proto_twin = post_fb(client, fwdbwd_body(model_id, 2))  # the same datum as 0.38 sends it
    out = result(client, fb)  # default Accept: protobuf, as before
    assert not isinstance(out, dict)
    as_json = client.post(
        "/api/v1/retrieve_future", json={"request_id": fb["request_id"]}, headers=json_h
    ).json()
    assert as_json["loss_fn_output_type"] and "loss:sum" in as_json["metrics"]
    lp = as_json["loss_fn_outputs"][0]["logprobs"]
    assert lp["dtype"] == "float32" and lp["shape"] == [3] and len(lp["data"]) == 3
    twin = client.post("/api/v1/retrieve_future", json=proto_twin.json(), headers=json_h).json()
    assert twin["metrics"]["loss:sum"] == pytest.approx(as_json["metrics"]["loss:sum"], abs=1e-6)
    fwd = client.post(
        "/api/v1/forward",
        json={
            "model_id": model_id,
            "seq_id": 3,
            "forward_input": {"data": [_json_datum([1, 2, 3])], "loss_fn": "cross_entropy"},
        },
    ).json()
    got = client.post("/api/v1/retrieve_future", json=fwd, headers=json_h)
    while got.json().get("type") == "try_again":
        got = client.post("/api/v1/retrieve_future", json=fwd, headers=json_h)
    assert got.json()["metrics"]["loss:sum"] == pytest.approx(
        as_json["metrics"]["loss:sum"], abs=1e-6
    )
    bad = client.post(
        "/api/v1/forward_backward",
        json={"model_id": model_id, "seq_id": 4, "forward_backward_input": {"data": "x"}},
    )
    assert (
        bad.status_code == 400 and "forward_backward_input.data" in bad.json()["error"]["message"]
    )
    unload = client.post("/api/v1/unload_model", json={"model_id": model_id}).json()
    assert result(client, unload)["type"] == "unload_model"


def test_create_session_warns_deprecated_sdks(env):
    client, _, _ = env
    old = client.post("/api/v1/create_session", json={"sdk_version": "0.16.1"}).json()
    assert "0.16.1" in old["warning_message"] and "error_message" not in old
    new = client.post(
        "/api/v1/create_session",
        json={"sdk_version": "0.38.0"},
        headers={"User-Agent": "AsyncTinker/Python 0.38.0"},
    ).json()
    assert "warning_message" not in new and "error_message" not in new
