"""Helpers for the Tinker REST surface tests (tests/gateway/test_tinker_*.py): an app whose
client sends alice's key, and the calls those tests repeat."""

from __future__ import annotations

from fastapi.testclient import TestClient
from tinker import types

from tests.gateway import harness


def tinker_env(make_gateway, **config) -> tuple[TestClient, object, str]:
    """(client with alice's key, the app's Trainer, bob's key) on a new app (real SQLite,
    in-process engine); ``config`` are extra `ServerConfig` fields."""
    gw = make_gateway(metadata_only_min_bytes=0, **config)
    gw.client.headers["X-API-Key"] = gw.key("alice")
    other = gw.key("bob")
    return gw.client, gw.engines[harness.BASE]["trainer"], other


def session(client: TestClient) -> str:
    return harness.session(client, None)


def result(client: TestClient, fut: dict, **extra):
    """The finished future, the whole payload (no metadata-only answer)."""
    return harness.wait_future(client, None, fut, allow_metadata_only=False, **extra)


def model(client: TestClient, sid: str | None = None, seq: int = 0) -> str:
    return harness.model(client, None, sid, seq)


def fwdbwd_body(model_id: str, seq_id: int, tokens=(1, 2, 3)) -> bytes:
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(list(tokens)),
        loss_fn_inputs={"target_tokens": [t + 1 for t in tokens], "weights": [1.0] * len(tokens)},
    )
    return harness.fwdbwd_body(model_id, seq_id, [datum])


def post_fb(client: TestClient, body: bytes):
    return harness.post_fwdbwd(client, None, body)


def save(client, model_id: str, seq_id: int, route: str, name: str, **extra) -> str:
    fut = client.post(
        f"/api/v1/{route}", json={"model_id": model_id, "seq_id": seq_id, "path": name, **extra}
    ).json()
    out = result(client, fut)
    assert "path" in out, out
    return out["path"]
