"""Shared by the accounts / quota / isolation tests: build the real gateway app (in-process engine
on the tiny model, real SQLite or Postgres, optionally a real Redis) and make orgs, users, keys."""

from __future__ import annotations

import os
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from fastapi.testclient import TestClient  # noqa: E402
from tinker import types  # noqa: E402
from tinker.proto.request_conv import forward_backward_request_to_proto  # noqa: E402

from engine.sampler import Sampler  # noqa: E402
from engine.trainer import Trainer  # noqa: E402
from gateway.accounts.service import create_key, ensure_user  # noqa: E402
from gateway.config import ServerConfig  # noqa: E402
from gateway.db import make_engine, session_scope, upgrade_to_head  # noqa: E402
from gateway.engine_client import EngineClient  # noqa: E402
from gateway.main import create_app  # noqa: E402
from gateway.quotas.limits import set_limit  # noqa: E402
from gateway.settings import Settings  # noqa: E402

BASE = "twinkle/tiny-chat"


def build_engines(data: Path, n: int = 1) -> list[dict]:
    m = ServerConfig().models[0]
    return [
        {BASE: {"trainer": Trainer(m, str(data)), "sampler": Sampler(m, str(data))}}
        for _ in range(n)
    ]


def make_app(data: Path, db_url: str, engines: dict, **gateway: object):
    upgrade_to_head(db_url)
    settings = Settings(data_dir=data, database_url=db_url)
    config = ServerConfig.model_validate({"long_poll_seconds": 0.5, "gateway": gateway})
    return create_app(settings, config, EngineClient(engines, ray_handles=False))


def new_key(db_url: str, user: str, org: str = "acme", scope: str = "user") -> str:
    db = make_engine(db_url)
    try:
        with session_scope(db) as s:
            u = ensure_user(s, user, org_name=org)
            assert u.id is not None
            return create_key(s, u.id, scope=scope)[0]
    finally:
        db.dispose()


def set_quota(db_url: str, level: str, name: str, quota: str, value: int | None) -> None:
    """Set a quota for org ``name`` or user ``name``."""
    from sqlmodel import select

    from gateway.db.tables import OrganizationRow, UserRow

    db = make_engine(db_url)
    try:
        with session_scope(db) as s:
            row_t = OrganizationRow if level == "org" else UserRow
            row = s.exec(select(row_t).where(row_t.name == name)).one()
            set_limit(s, level, row.id, quota, value)
    finally:
        db.dispose()


def session(client: TestClient, key: str) -> str:
    r = client.post("/api/v1/create_session", json={}, headers={"X-API-Key": key})
    assert r.status_code == 200, r.text
    return r.json()["session_id"]


def create_model(client: TestClient, key: str, sid: str, seq: int, rank: int = 4):
    return client.post(
        "/api/v1/create_model",
        headers={"X-API-Key": key},
        json={
            "session_id": sid,
            "model_seq_id": seq,
            "base_model": BASE,
            "lora_config": {"rank": rank},
        },
    )


def wait(client: TestClient, key: str, fut: dict, timeout: float = 60):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        r = client.post(
            "/api/v1/retrieve_future",
            json={"request_id": fut["request_id"]},
            headers={"X-API-Key": key},
        )
        if r.headers.get("content-type") == "application/x-protobuf":
            return r
        body = r.json()
        if body.get("type") != "try_again":
            return body
    raise TimeoutError(fut)


def model(client: TestClient, key: str, sid: str, seq: int = 0, rank: int = 4) -> str:
    r = create_model(client, key, sid, seq, rank)
    assert r.status_code == 200, r.text
    assert wait(client, key, r.json())["model_id"]
    return r.json()["model_id"]


def fwdbwd(client: TestClient, key: str, model_id: str, seq_id: int, n_tokens: int = 10):
    toks = [(i % 50) + 1 for i in range(n_tokens)]
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(toks),
        loss_fn_inputs={"target_tokens": toks, "weights": [1.0] * n_tokens},
    )
    req = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=[datum], loss_fn="cross_entropy"),
        model_id=model_id,
        seq_id=seq_id,
    )
    body = forward_backward_request_to_proto(req).SerializeToString()
    return client.post(
        "/api/v1/forward_backward",
        content=body,
        headers={"Content-Type": "application/x-protobuf", "X-API-Key": key},
    )
