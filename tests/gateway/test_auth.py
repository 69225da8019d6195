"""API-key authentication end to end: a tiny FastAPI app using `PrincipalDep` over a migrated
SQLite file; rejected keys answer 401 JSON; the key never shows up in responses, logs or the DB."""

from __future__ import annotations

import base64
import logging
import secrets
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from sqlalchemy import Engine
from sqlmodel import Session, select

from gateway.accounts.keys import (
    AdminPrincipalDep,
    Principal,
    PrincipalDep,
    authenticate,
    digest_key,
    generate_api_key,
)
from gateway.db import make_engine, session_scope, upgrade_to_head
from gateway.db.tables import ApiKeyRow, UserRow, utcnow
from gateway.errors import AuthenticationError, register_exception_handlers
from tests.gateway.harness import new_key


@pytest.fixture
def db_path(tmp_path: Path) -> Path:
    return tmp_path / "auth.db"


@pytest.fixture
def engine(db_path: Path) -> Iterator[Engine]:
    url = f"sqlite:///{db_path}"
    upgrade_to_head(url)
    eng = make_engine(url)
    yield eng
    eng.dispose()


@pytest.fixture
def client(engine: Engine) -> Iterator[TestClient]:
    app = FastAPI()
    register_exception_handlers(app)
    # what get_principal reads of the app's services: the DB engine, and no JWT issuer
    app.state.services = SimpleNamespace(db_engine=engine, jwt=None)

    @app.get("/whoami")
    def whoami(principal: PrincipalDep) -> dict:
        return {"user": principal.user_name, "scope": principal.scope, "user_id": principal.user_id}

    @app.get("/admin-only")
    def admin_only(principal: AdminPrincipalDep) -> dict:
        return {"user": principal.user_name}

    with TestClient(app) as c:
        yield c


def _new_key(engine: Engine, user: str = "alice", admin: bool = False) -> str:
    return new_key(engine, user, org=None, scope="admin" if admin else "user")


def _assert_401(resp, *secrets_: str) -> None:
    assert resp.status_code == 401
    body = resp.json()
    assert body["error"]["code"] == "unauthenticated"
    assert body["error"]["message"] and body["detail"] == body["error"]["message"]
    assert body["request_id"]
    assert resp.headers["x-should-retry"] == "false"
    for s in secrets_:
        assert s not in resp.text
        assert all(s not in v for v in resp.headers.values())


def test_generated_keys_have_prefix_and_32_random_bytes() -> None:
    keys = {generate_api_key() for _ in range(50)}
    assert len(keys) == 50
    for key in keys:
        assert key.startswith("tml-")
        raw = base64.urlsafe_b64decode(key[4:] + "=" * (-len(key[4:]) % 4))
        assert len(raw) >= 32


def test_missing_key_is_401_json(client: TestClient) -> None:
    _assert_401(client.get("/whoami"))


@pytest.mark.parametrize(
    "headers",
    [
        {"X-API-Key": "sk-foo"},
        {"Authorization": "Bearer sk-foo"},
        {"Authorization": "Basic dXNlcjpwYXNz"},
        {"Twinkle-Authorization": "Bearer "},
        {"X-API-Key": "tml-" + "x" * 1000},
    ],
)
def test_malformed_keys_are_401(client: TestClient, headers: dict[str, str]) -> None:
    tokens = [v.split(" ", 1)[-1] for v in headers.values()]
    _assert_401(client.get("/whoami", headers=headers), *[t for t in tokens if t])


def test_unknown_tml_key_is_401(client: TestClient, engine: Engine) -> None:
    _new_key(engine)
    unknown = generate_api_key()
    _assert_401(client.get("/whoami", headers={"X-API-Key": unknown}), unknown)


@pytest.mark.parametrize(
    "header,template",
    [
        ("X-API-Key", "{key}"),
        ("Authorization", "Bearer {key}"),
        ("Twinkle-Authorization", "Bearer {key}"),
        ("authorization", "bearer  {key} "),
    ],
)
def test_valid_key_in_each_header(
    client: TestClient, engine: Engine, header: str, template: str
) -> None:
    key = _new_key(engine)
    resp = client.get("/whoami", headers={header: template.format(key=key)})
    assert resp.status_code == 200, resp.text
    assert resp.json()["user"] == "alice" and resp.json()["scope"] == "user"
    assert key not in resp.text


def test_revoked_key_fails_on_next_request(client: TestClient, engine: Engine) -> None:
    key = _new_key(engine)
    other = _new_key(engine, user="bob")
    assert client.get("/whoami", headers={"X-API-Key": key}).status_code == 200
    with session_scope(engine) as session:
        row = session.exec(select(ApiKeyRow).where(ApiKeyRow.digest == digest_key(key))).one()
        row.revoked_at = utcnow()
        session.add(row)
    _assert_401(client.get("/whoami", headers={"X-API-Key": key}), key)
    assert client.get("/whoami", headers={"X-API-Key": other}).status_code == 200


def test_admin_scope(client: TestClient, engine: Engine) -> None:
    user_key = _new_key(engine, user="carol")
    admin_key = _new_key(engine, user="root", admin=True)
    resp = client.get("/admin-only", headers={"X-API-Key": user_key})
    assert resp.status_code == 403 and resp.json()["error"]["code"] == "permission_denied"
    assert client.get("/admin-only", headers={"X-API-Key": admin_key}).status_code == 200
    assert client.get("/whoami", headers={"X-API-Key": admin_key}).json()["scope"] == "admin"


def test_one_user_many_keys_and_admin_promotion(engine: Engine) -> None:
    k1 = _new_key(engine, user="dave")
    k2 = _new_key(engine, user="dave", admin=True)
    assert k1 != k2
    with Session(engine) as session:
        users = session.exec(select(UserRow).where(UserRow.name == "dave")).all()
        assert len(users) == 1 and users[0].is_admin
        p1, p2 = authenticate(session, k1), authenticate(session, k2)
    assert isinstance(p1, Principal)
    assert p1.user_id == p2.user_id and (p1.scope, p2.scope) == ("user", "admin")
    assert p1.key_id != p2.key_id


def test_unknown_keys_do_the_same_comparison_work(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    key = _new_key(engine)
    calls: list[tuple[int, int]] = []
    real = secrets.compare_digest

    def counting(a, b):  # type: ignore[no-untyped-def]
        calls.append((len(a), len(b)))
        return real(a, b)

    monkeypatch.setattr(secrets, "compare_digest", counting)
    with Session(engine) as session:
        authenticate(session, key)
        with pytest.raises(AuthenticationError):
            authenticate(session, generate_api_key())
    assert calls == [(64, 64), (64, 64)]


def test_key_never_in_responses_logs_or_database(
    client: TestClient, engine: Engine, db_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    key = _new_key(engine, user="erin")
    revoked = _new_key(engine, user="erin")
    with session_scope(engine) as session:
        row = session.exec(select(ApiKeyRow).where(ApiKeyRow.digest == digest_key(revoked))).one()
        row.revoked_at = utcnow()
    bodies: list[str] = []
    for headers in (
        {"X-API-Key": key},
        {"Authorization": f"Bearer {key}"},
        {"X-API-Key": revoked},
        {"X-API-Key": key + "x"},
        {"X-API-Key": key.replace("tml-", "sk-")},
    ):
        resp = client.get("/whoami", headers=headers)
        bodies.append(resp.text + repr(dict(resp.headers)))
    secret_parts = [key, key[10:], revoked, revoked[10:]]
    for s in secret_parts:
        assert all(s not in b for b in bodies)
        assert s not in caplog.text

    # The database holds only digests and display prefixes: scan every table's text...
    with engine.connect() as conn:
        sql = "SELECT name FROM sqlite_master WHERE type='table'"
        tables = [r[0] for r in conn.exec_driver_sql(sql)]
        dump = " ".join(
            str(value)
            for table in tables
            for row in conn.exec_driver_sql(f'SELECT * FROM "{table}"')
            for value in row
        )
        conn.exec_driver_sql("PRAGMA wal_checkpoint(FULL)")
    assert digest_key(key) in dump and key[:10] in dump
    for s in secret_parts:
        assert s not in dump
    # ... and the raw bytes of the file and its WAL.
    for f in db_path.parent.glob(db_path.name + "*"):
        data = f.read_bytes()
        for s in secret_parts:
            assert s.encode() not in data, f
