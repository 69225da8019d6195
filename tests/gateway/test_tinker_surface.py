"""The gateway's Tinker surface with a real in-process Trainer/Sampler on the tiny model and real
SQLite: request ids, X-Idempotency-Key replay, seq_id conflicts, future expiry (410),
allow_metadata_only, session expiry releasing adapters, checkpoint TTL expiry, signed download URLs,
and SDK deprecation headers. Short timeouts make expiry testable in seconds."""

from __future__ import annotations

import os
import time
from pathlib import Path
from urllib.parse import parse_qs, urlencode, urlparse

import pytest
from fastapi.testclient import TestClient
from tinker import types
from tinker.proto.request_conv import forward_backward_request_to_proto

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from engine.sampler import Sampler  # noqa: E402
from engine.trainer import Trainer  # noqa: E402
from gateway.accounts.service import create_user_and_key  # noqa: E402
from gateway.config import ServerConfig  # noqa: E402
from gateway.db import make_engine, session_scope, upgrade_to_head  # noqa: E402
from gateway.engine_client import EngineClient  # noqa: E402
from gateway.main import create_app  # noqa: E402
from gateway.middleware import deprecation_for, parse_version  # noqa: E402
from gateway.settings import Settings  # noqa: E402

BASE = "twinkle/tiny-chat"


def _app(tmp_path_factory, **config_overrides):
    data = Path(tmp_path_factory.mktemp("data"))
    settings = Settings(data_dir=data, database_url=f"sqlite:///{data}/twinkle.db")
    upgrade_to_head(settings.database_url)
    with session_scope(make_engine(settings.database_url)) as s:
        key = create_user_and_key(s, user_name="alice", admin=False)
        other = create_user_and_key(s, user_name="bob", admin=False)
    config = ServerConfig(long_poll_seconds=0.5, metadata_only_min_bytes=0, **config_overrides)
    m = config.models[0]
    trainer = Trainer(m, str(data))
    engines = {BASE: {"trainer": trainer, "sampler": Sampler(m, str(data))}}
    app = create_app(settings, config, EngineClient(engines, ray_handles=False))
    with TestClient(app) as client:
        client.headers["X-API-Key"] = key
        yield client, trainer, other


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """Default timeouts: nothing expires while a test runs."""
    yield from _app(tmp_path_factory)


@pytest.fixture(scope="module")
def short_env(tmp_path_factory):
    """Futures kept 1.5 s, sessions expire after 3 s without a heartbeat (swept every 0.3 s)."""
    yield from _app(
        tmp_path_factory,
        future_ttl_seconds=1.5,
        session_timeout_seconds=3.0,
        session_sweep_seconds=0.3,
    )


def _session(client) -> str:
    return client.post("/api/v1/create_session", json={}).json()["session_id"]


def _result(client, fut: dict, **extra):
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        r = client.post(
            "/api/v1/retrieve_future",
            json={"request_id": fut["request_id"], "allow_metadata_only": False, **extra},
        )
        assert r.status_code == 200, r.text
        if r.headers["content-type"].startswith("application/x-protobuf"):
            return r
        body = r.json()
        if body.get("type") != "try_again":
            return body
    raise AssertionError("future did not finish")


def _model(client, sid: str | None = None, seq: int = 0) -> str:
    sid = sid or _session(client)
    fut = client.post(
        "/api/v1/create_model",
        json={
            "session_id": sid,
            "model_seq_id": seq,
            "base_model": BASE,
            "lora_config": {"rank": 4},
        },
    ).json()
    assert _result(client, fut)["model_id"]
    return fut["model_id"]


def _fwdbwd_body(model_id: str, seq_id: int, tokens=(1, 2, 3)) -> bytes:
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(list(tokens)),
        loss_fn_inputs={"target_tokens": [t + 1 for t in tokens], "weights": [1.0] * len(tokens)},
    )
    req = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=[datum], loss_fn="cross_entropy"),
        model_id=model_id,
        seq_id=seq_id,
    )
    return forward_backward_request_to_proto(req).SerializeToString()


def _post_fb(client, body: bytes):
    return client.post(
        "/api/v1/forward_backward", content=body, headers={"Content-Type": "application/x-protobuf"}
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
    model_id = _model(client)
    first = _post_fb(client, _fwdbwd_body(model_id, 1))
    again = _post_fb(client, _fwdbwd_body(model_id, 1))
    assert first.json()["request_id"] == again.json()["request_id"]
    clash = _post_fb(client, _fwdbwd_body(model_id, 1, tokens=(4, 5, 6)))
    assert clash.status_code == 409, clash.text
    assert "seq_id" in clash.json()["error"]["message"]
    opt = {"model_id": model_id, "seq_id": 2, "adam_params": {"learning_rate": 0.01}}
    r1 = client.post("/api/v1/optim_step", json=opt).json()
    r2 = client.post("/api/v1/optim_step", json={**opt, "adam_params": {"learning_rate": 0.5}})
    assert r2.status_code == 409
    assert "grad_norm" in _result(client, r1)["metrics"]


def test_metadata_only_then_payload(env):
    client, _, _ = env
    model_id = _model(client)
    fut = _post_fb(client, _fwdbwd_body(model_id, 1)).json()
    while True:
        meta = client.post(
            "/api/v1/retrieve_future",
            json={"request_id": fut["request_id"], "allow_metadata_only": True},
        ).json()
        if meta.get("type") != "try_again":
            break
    assert meta["status"] == "complete_metadata" and meta["response_payload_size"] > 0
    full = _result(client, fut)
    assert len(full.content) == meta["response_payload_size"]


def test_expired_future_is_410(short_env):
    client, _, _ = short_env
    model_id = _model(client)
    fut = client.post(
        "/api/v1/optim_step",
        json={"model_id": model_id, "seq_id": 1, "adam_params": {"learning_rate": 0.01}},
    ).json()
    _result(client, fut)  # finishes (a user error: no gradient), then expires after 1.5 s
    time.sleep(2.0)
    _session(client)  # any submit/lookup runs the expiry
    r = client.post("/api/v1/retrieve_future", json={"request_id": fut["request_id"]})
    assert r.status_code == 410, r.text
    assert "expired" in r.json()["error"]["message"]


def test_silent_session_expires_and_releases_adapters(short_env):
    client, trainer, _ = short_env
    sid = _session(client)
    model_id = _model(client, sid)
    assert trainer.backend.has_adapter(model_id)
    deadline = time.monotonic() + 10
    while trainer.backend.has_adapter(model_id) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not trainer.backend.has_adapter(model_id)
    hb = client.post("/api/v1/session_heartbeat", json={"session_id": sid})
    assert hb.status_code == 410 and "expired" in hb.json()["error"]["message"]
    fb = _post_fb(client, _fwdbwd_body(model_id, 1))
    assert fb.status_code == 410 and "create_training_client_from_state" in fb.text
    # The run is still listed (history stays), with a session marked expired.
    assert client.get(f"/api/v1/training_runs/{model_id}").status_code == 200
    assert client.get(f"/api/v1/sessions/{sid}").json()["status"] == "expired"


def test_heartbeats_keep_a_session_alive(short_env):
    client, trainer, _ = short_env
    sid = _session(client)
    model_id = _model(client, sid)
    for _ in range(16):  # 4.8 s > the 3 s timeout, with a heartbeat every 0.3 s
        assert client.post("/api/v1/session_heartbeat", json={"session_id": sid}).status_code == 200
        time.sleep(0.3)
    assert trainer.backend.has_adapter(model_id)


def _save(client, model_id: str, seq_id: int, route: str, name: str, **extra) -> str:
    fut = client.post(
        f"/api/v1/{route}", json={"model_id": model_id, "seq_id": seq_id, "path": name, **extra}
    ).json()
    out = _result(client, fut)
    assert "path" in out, out
    return out["path"]


def test_checkpoint_ttl_expiry_deletes_and_404s(env):
    client, _, _ = env
    model_id = _model(client)
    path = _save(client, model_id, 1, "save_weights", "short")
    run, ckpt = path[len("tinker://") :].split("/", 1)
    r = client.put(f"/api/v1/training_runs/{run}/checkpoints/{ckpt}/ttl", json={"ttl_seconds": 1})
    assert r.status_code == 200 and r.json()["expires_at"]
    info = client.post("/api/v1/weights_info", json={"tinker_path": path})
    assert info.status_code == 200 and info.json()["lora_rank"] == 4
    files = list((Path(client.app.state.settings.data_dir) / "checkpoints").rglob("short-*"))
    assert files
    time.sleep(1.2)
    assert client.post("/api/v1/weights_info", json={"tinker_path": path}).status_code == 404
    assert not any(f.exists() for f in files)
    listed = client.get(f"/api/v1/training_runs/{run}/checkpoints").json()["checkpoints"]
    assert listed == []


def test_signed_download_urls(env):
    client, _, _ = env
    model_id = _model(client)
    path = _save(client, model_id, 1, "save_weights_external", "hf")
    assert path == f"tinker://{model_id}/external_weights/hf"
    run, ckpt = path[len("tinker://") :].split("/", 1)
    urls = client.get(f"/api/v1/training_runs/{run}/checkpoints/{ckpt}/external_weights_urls")
    assert urls.status_code == 200, urls.text
    body = urls.json()
    assert set(body["urls"]) == {"adapter_model.safetensors", "adapter_config.json"}
    url = urlparse(body["urls"]["adapter_config.json"])
    anon = {"X-API-Key": ""}
    ok = client.get(f"{url.path}?{url.query}", headers=anon)
    assert ok.status_code == 200 and b"lora" in ok.content.lower()
    q = {k: v[0] for k, v in parse_qs(url.query).items()}
    tampered = client.get(f"{url.path}?{urlencode({**q, 'sig': '0' * 64})}", headers=anon)
    assert tampered.status_code == 403
    later = client.get(
        f"{url.path}?{urlencode({**q, 'expires': int(q['expires']) + 3600})}", headers=anon
    )
    assert later.status_code == 403  # extending the expiry breaks the signature
    other_file = client.get(
        f"{url.path.replace('adapter_config.json', 'adapter_model.safetensors')}?{url.query}",
        headers=anon,
    )
    assert other_file.status_code == 403  # a signature is for one file
    # An expired URL with a valid signature (signed here with the server's key) is 410.
    from gateway.db.tables import CheckpointRow
    from gateway.tinker_api.exports import _signature

    row_id = int(url.path.split("/")[-2])
    with session_scope(client.app.state.db_engine) as s:
        row = s.get(CheckpointRow, row_id)
        past = int(time.time()) - 5
        sig = _signature(
            client.app.state.secrets.url_signing, row, "adapter_config.json", past
        )
    expired = client.get(f"{url.path}?{urlencode({'expires': past, 'sig': sig})}", headers=anon)
    assert expired.status_code == 410 and "expired" in expired.json()["error"]["message"]


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


def test_copy_weights_hard_links_and_survives_source_delete(env):
    client, _, _ = env
    model_id = _model(client)
    path = _save(client, model_id, 1, "save_weights", "src")
    alias = path.replace("tinker://", "twinkle://")
    r = client.post(
        "/api/v1/copy_weights", json={"source_path": alias, "destination_project_id": "p"}
    )
    assert r.status_code == 200, r.text
    copy = r.json()["tinker_path"]
    assert copy.startswith("tinker://") and copy.endswith("/weights/src") and copy != path
    root = Path(client.app.state.settings.data_dir) / "checkpoints"
    src_file, copy_file = sorted(root.rglob("src-*/adapter_model.safetensors"), key=str)[:2]
    assert src_file.stat().st_ino == copy_file.stat().st_ino  # hard link: no bytes duplicated
    run, ckpt = path[len("tinker://") :].split("/", 1)
    assert client.delete(f"/api/v1/training_runs/{run}/checkpoints/{ckpt}").status_code == 200
    assert client.post("/api/v1/weights_info", json={"tinker_path": copy}).status_code == 200
    # Into a session slot instead of a project; a taken slot is refused.
    sid = _session(client)
    slot = {"source_path": copy, "session_id": sid, "model_seq_id": 3}
    assert (
        client.post("/api/v1/copy_weights", json=slot)
        .json()["tinker_path"]
        .startswith(f"tinker://{sid}:train:3/")
    )
    again = client.post("/api/v1/copy_weights", json=slot)
    assert again.status_code == 400 and "model_seq_id" in again.json()["error"]["message"]
    neither = client.post("/api/v1/copy_weights", json={"source_path": copy})
    assert neither.status_code == 400 and "destination_project_id" in neither.text


def test_publish_is_owner_only_and_makes_readable(env):
    client, _, other = env
    model_id = _model(client)
    path = _save(client, model_id, 1, "save_weights_for_sampler", "pub")
    run, ckpt = path[len("tinker://") :].split("/", 1)
    as_bob = {"X-API-Key": other}
    assert (
        client.post("/api/v1/weights_info", json={"tinker_path": path}, headers=as_bob).status_code
        == 404
    )
    assert client.post(f"/api/v1/training_runs/{run}/checkpoints/{ckpt}/publish").json()["public"]
    assert (
        client.post("/api/v1/weights_info", json={"tinker_path": path}, headers=as_bob).status_code
        == 200
    )
    for method in ("delete", "post"):
        url = f"/api/v1/training_runs/{run}/checkpoints/{ckpt}" + (
            "/publish" if method == "post" else ""
        )
        assert client.request(method.upper(), url, headers=as_bob).status_code == 404
    got = client.get(f"/api/v1/training_runs/{run}?access_scope=accessible", headers=as_bob)
    assert got.status_code == 200 and got.json()["model_owner"] == "alice"
    assert client.get(f"/api/v1/training_runs/{run}", headers=as_bob).status_code == 404  # owned
    assert (
        client.delete(f"/api/v1/training_runs/{run}/checkpoints/{ckpt}/publish").status_code == 200
    )
    assert (
        client.post("/api/v1/weights_info", json={"tinker_path": path}, headers=as_bob).status_code
        == 404
    )


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
    model_id = _model(client)
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
    proto_twin = _post_fb(client, _fwdbwd_body(model_id, 2))  # the same datum as 0.38 sends it
    out = _result(client, fb)  # default Accept: protobuf, as before
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
    assert _result(client, unload)["type"] == "unload_model"


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
