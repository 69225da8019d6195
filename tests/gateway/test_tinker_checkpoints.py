"""The gateway's Tinker surface, checkpoints (real in-process Trainer on the tiny model, real
SQLite): TTL expiry, signed download URLs, copy_weights hard links, publishing."""

from __future__ import annotations

import time
from pathlib import Path
from urllib.parse import parse_qs, urlencode, urlparse

import pytest

from gateway.context import services_of
from gateway.db import session_scope
from tests.gateway.tinker_rest import (
    model,
    save,
    session,
    tinker_env,
)


@pytest.fixture(scope="module")
def env(make_gateway):
    """Default timeouts: nothing expires while a test runs."""
    return tinker_env(make_gateway)


def test_checkpoint_ttl_expiry_deletes_and_404s(env):
    client, _, _ = env
    model_id = model(client)
    path = save(client, model_id, 1, "save_weights", "short")
    run, ckpt = path[len("tinker://") :].split("/", 1)
    r = client.put(f"/api/v1/training_runs/{run}/checkpoints/{ckpt}/ttl", json={"ttl_seconds": 1})
    assert r.status_code == 200 and r.json()["expires_at"]
    info = client.post("/api/v1/weights_info", json={"tinker_path": path})
    assert info.status_code == 200 and info.json()["lora_rank"] == 4
    files = list((Path(services_of(client.app).settings.data_dir) / "checkpoints").rglob("short-*"))
    assert files
    time.sleep(1.2)
    assert client.post("/api/v1/weights_info", json={"tinker_path": path}).status_code == 404
    assert not any(f.exists() for f in files)
    listed = client.get(f"/api/v1/training_runs/{run}/checkpoints").json()["checkpoints"]
    assert listed == []


def test_signed_download_urls(env):
    client, _, _ = env
    model_id = model(client)
    path = save(client, model_id, 1, "save_weights_external", "hf")
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
    with session_scope(services_of(client.app).db_engine) as s:
        row = s.get(CheckpointRow, row_id)
        past = int(time.time()) - 5
        sig = _signature(
            services_of(client.app).secrets.url_signing, row, "adapter_config.json", past
        )
    expired = client.get(f"{url.path}?{urlencode({'expires': past, 'sig': sig})}", headers=anon)
    assert expired.status_code == 410 and "expired" in expired.json()["error"]["message"]


def test_copy_weights_hard_links_and_survives_source_delete(env):
    client, _, _ = env
    model_id = model(client)
    path = save(client, model_id, 1, "save_weights", "src")
    alias = path.replace("tinker://", "twinkle://")
    r = client.post(
        "/api/v1/copy_weights", json={"source_path": alias, "destination_project_id": "p"}
    )
    assert r.status_code == 200, r.text
    copy = r.json()["tinker_path"]
    assert copy.startswith("tinker://") and copy.endswith("/weights/src") and copy != path
    root = Path(services_of(client.app).settings.data_dir) / "checkpoints"
    src_file, copy_file = sorted(root.rglob("src-*/adapter_model.safetensors"), key=str)[:2]
    assert src_file.stat().st_ino == copy_file.stat().st_ino  # hard link: no bytes duplicated
    run, ckpt = path[len("tinker://") :].split("/", 1)
    assert client.delete(f"/api/v1/training_runs/{run}/checkpoints/{ckpt}").status_code == 200
    assert client.post("/api/v1/weights_info", json={"tinker_path": copy}).status_code == 200
    # Into a session slot instead of a project; a taken slot is refused.
    sid = session(client)
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
    model_id = model(client)
    path = save(client, model_id, 1, "save_weights_for_sampler", "pub")
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
    assert got.status_code == 200 and got.json()["model_owner"] == "published"  # not who
    assert client.get(f"/api/v1/training_runs/{run}", headers=as_bob).status_code == 404  # owned
    assert (
        client.delete(f"/api/v1/training_runs/{run}/checkpoints/{ckpt}/publish").status_code == 200
    )
    assert (
        client.post("/api/v1/weights_info", json={"tinker_path": path}, headers=as_bob).status_code
        == 404
    )
