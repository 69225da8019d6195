"""No server filesystem path reaches a client, through the real gateway app (real Trainer on the
tiny model, real SQLite): a checkpoint whose files are damaged fails its Tinker load (a failed
future) and its native Twinkle load (an HTTP 400) with the checkpoint's name but not its storage
directory, and the server log keeps the full path."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

import twinkle_client
from gateway.errors import redact_paths
from tests.gateway.harness import BASE
from tests.gateway.test_twinkle_api import _Transport
from tests.gateway.tinker_rest import model, result, save, session
from twinkle_client.model import MultiLoraTransformersModel as RemoteModel


@pytest.fixture(scope="module")
def gw(make_gateway):
    gw = make_gateway(metadata_only_min_bytes=0)
    gw.client.headers["X-API-Key"] = gw.key("alice")
    return gw


def _damage(data: Path, name: str) -> Path:
    """Overwrite the manifest of the checkpoint saved as ``name``; its directory."""
    (ckpt,) = [p for p in (data / "checkpoints").rglob(f"{name}*") if p.is_dir()]
    (ckpt / "manifest.json").write_text("not json")
    return ckpt


def _assert_no_server_path(text: str, data: Path) -> None:
    assert str(data) not in text and "/checkpoints/" not in text, text
    assert redact_paths(text) == text, text  # no absolute path of any kind


def test_a_failed_future_names_no_server_path(gw, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="gateway.engine_client.transport")
    client = gw.client
    model_id = model(client)
    path = save(client, model_id, 1, "save_weights", "damaged")
    ckpt = _damage(gw.data, "damaged")
    body = {"path": path, "session_id": session(client), "model_seq_id": 0}
    new = result(client, client.post("/api/v1/load_weights", json=body).json())
    in_place = {"path": path, "model_id": model_id, "seq_id": 2}
    old = result(client, client.post("/api/v1/load_weights", json=in_place).json())
    for out in (new, old):
        assert out["category"] == "user" and "manifest" in out["error"], out
        assert "damaged-" in out["error"]  # the checkpoint's own name stays
        _assert_no_server_path(out["error"], gw.data)
    assert str(ckpt) in caplog.text  # the operator still sees where


def test_an_http_error_names_no_server_path(gw) -> None:
    bob = twinkle_client.TwinkleClient(
        "http://testserver",
        gw.key("bob"),
        transport=_Transport(gw.client._transport),
        session_heartbeat_interval=None,
    )
    m = RemoteModel(BASE, client=bob)
    m.add_adapter_to_model("a", {"r": 4})
    m.save("broken", adapter_name="a")
    _damage(gw.data, "broken")
    with pytest.raises(twinkle_client.InvalidRequestError) as err:
        m.load("broken", adapter_name="a")
    assert "manifest" in str(err.value)
    _assert_no_server_path(str(err.value), gw.data)
