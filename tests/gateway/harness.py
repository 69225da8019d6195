"""Helpers for gateway tests: build the real gateway app (in-process engine on the tiny model, real
SQLite or Postgres, optionally a real Redis), mint keys, and wait for futures.

The fixtures in tests/gateway/conftest.py wrap these; import the plain functions here when a test
needs them outside a fixture (a uvicorn server, a second app on the same engines, ...).
"""

from __future__ import annotations

import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import sqlalchemy as sa
from fastapi import FastAPI
from fastapi.testclient import TestClient
from tinker import types
from tinker.proto.request_conv import forward_backward_request_to_proto

from gateway.accounts.service import create_key, ensure_user
from gateway.config import ServerConfig
from gateway.db import make_engine, session_scope, upgrade_to_head
from gateway.engine_client import EngineClient
from gateway.main import create_app
from gateway.quotas.limits import set_limit
from gateway.settings import Settings
from tests.tiny_models import seed_models

BASE = "twinkle/tiny-chat"


# -- the app ------------------------------------------------------------------------------------


def sqlite_url(data: Path) -> str:
    return f"sqlite:///{data / 'twinkle.db'}"


def fresh_postgres_db(server_url: str) -> str:
    """A new empty database on the test Postgres server; returns its URL."""
    name = f"t_{uuid.uuid4().hex[:12]}"
    admin = sa.create_engine(server_url, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            conn.exec_driver_sql(f'CREATE DATABASE "{name}"')
    finally:
        admin.dispose()
    return server_url.rsplit("/", 1)[0] + "/" + name


def build_engines(data: Path, n: int = 1, backend: str = "transformers") -> list[dict]:
    """``n`` independent in-process engines ({base model: {"trainer", "sampler"}}) on the tiny
    model, each with its own Trainer and Sampler (the session's tiny model, copied under
    ``data``). ``backend="mock"``: engine/backends/mock.py for both (no torch, numbers that are
    not a language model's), for tests of HTTP semantics only."""
    from engine.sampler import Sampler  # torch: only where an engine is built
    from engine.trainer import Trainer

    seed_models(data, (BASE,))
    # sequential: what `auto` measures and picks on CPU anyway (README, engine), without paying
    # the start-up probe (~1-2 s) in every gateway test; the probe has its own unit tests
    update: dict[str, Any] = {"execution": "sequential"}
    if backend == "mock":
        update |= {"backend": "mock", "sampler_type": "mock"}
    m = ServerConfig().models[0].model_copy(update=update)
    return [
        {BASE: {"trainer": Trainer(m, str(data)), "sampler": Sampler(m, str(data))}}
        for _ in range(n)
    ]


def make_app(
    data: Path,
    db_url: str,
    engines: dict,
    *,
    gateway: dict | None = None,
    engine_client: EngineClient | None = None,
    **config: Any,
) -> FastAPI:
    """The real gateway app on migrated ``db_url``. ``config`` are `ServerConfig` fields
    (``long_poll_seconds`` defaults to 0.5), ``gateway`` its ``gateway`` section;
    ``engine_client`` replaces the plain in-process client on ``engines``."""
    upgrade_to_head(db_url)
    settings = Settings(data_dir=data, database_url=db_url)
    config.setdefault("long_poll_seconds", 0.5)
    cfg = ServerConfig.model_validate({**config, "gateway": gateway or {}})
    client = engine_client or EngineClient(engines, ray_handles=False)
    return create_app(settings, cfg, client)


# -- accounts -----------------------------------------------------------------------------------


def new_key(db: str | sa.Engine, user: str, org: str | None = "acme", scope: str = "user") -> str:
    """A new key for ``user`` (created in organization ``org`` if missing); ``scope="admin"``
    makes the user an admin. ``db`` is a database URL or an open engine (left open)."""
    engine = make_engine(db) if isinstance(db, str) else db
    try:
        with session_scope(engine) as s:
            u = ensure_user(s, user, org_name=org)
            assert u.id is not None
            return create_key(s, u.id, scope=scope)[0]
    finally:
        if isinstance(db, str):
            engine.dispose()


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


# -- Tinker REST calls --------------------------------------------------------------------------


def _headers(key: str | None) -> dict:
    return {"X-API-Key": key} if key else {}


def wait_future(
    client: TestClient, key: str | None, fut: dict, timeout: float = 60, **extra: Any
) -> Any:
    """Poll ``/retrieve_future`` until the future is done: its JSON body, or the response itself
    when the result is protobuf. ``key`` None uses the client's own headers; ``extra`` goes into
    the request body (e.g. ``allow_metadata_only=False``)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        r = client.post(
            "/api/v1/retrieve_future",
            json={"request_id": fut["request_id"], **extra},
            headers=_headers(key),
        )
        assert r.status_code == 200, r.text
        if r.headers.get("content-type", "").startswith("application/x-protobuf"):
            return r
        body = r.json()
        if body.get("type") != "try_again":
            return body
    raise TimeoutError(f"future did not finish in {timeout}s: {fut}")


def session(client: TestClient, key: str | None) -> str:
    r = client.post("/api/v1/create_session", json={}, headers=_headers(key))
    assert r.status_code == 200, r.text
    return r.json()["session_id"]


def create_model(client: TestClient, key: str | None, sid: str, seq: int, rank: int = 4):
    return client.post(
        "/api/v1/create_model",
        headers=_headers(key),
        json={
            "session_id": sid,
            "model_seq_id": seq,
            "base_model": BASE,
            "lora_config": {"rank": rank},
        },
    )


def model(
    client: TestClient, key: str | None, sid: str | None = None, seq: int = 0, rank: int = 4
) -> str:
    """A new LoRA model (in a new session unless ``sid``); waits until it exists."""
    sid = sid or session(client, key)
    r = create_model(client, key, sid, seq, rank)
    assert r.status_code == 200, r.text
    assert wait_future(client, key, r.json())["model_id"]
    return r.json()["model_id"]


def fwdbwd_body(model_id: str, seq_id: int, datums: list[types.Datum]) -> bytes:
    """A protobuf cross-entropy ``forward_backward`` request body."""
    req = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=datums, loss_fn="cross_entropy"),
        model_id=model_id,
        seq_id=seq_id,
    )
    return forward_backward_request_to_proto(req).SerializeToString()


def post_fwdbwd(client: TestClient, key: str | None, body: bytes) -> httpx.Response:
    return client.post(
        "/api/v1/forward_backward",
        content=body,
        headers={"Content-Type": "application/x-protobuf", **_headers(key)},
    )


def fwdbwd(client: TestClient, key: str | None, model_id: str, seq_id: int, n_tokens: int = 10):
    """Submit one ``n_tokens``-token cross-entropy step (token ids 1..50); the response."""
    toks = [(i % 50) + 1 for i in range(n_tokens)]
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(toks),
        loss_fn_inputs={"target_tokens": toks, "weights": [1.0] * n_tokens},
    )
    return post_fwdbwd(client, key, fwdbwd_body(model_id, seq_id, [datum]))
