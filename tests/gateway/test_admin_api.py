"""The admin REST API and the account rules through the real gateway (real SQLite and a real
Postgres server, in-process engine): orgs / users / keys / quotas CRUD with audit events, disable
and revoke effective on the next request, expiry, the usage ledger, engine status, and a grep of
every response, log line, DB value and the /metrics exposition for the raw keys."""

from __future__ import annotations

import logging
from datetime import UTC, datetime, timedelta

import pytest
import sqlalchemy as sa
from sqlalchemy import text

from gateway.context import services_of
from gateway.db import make_engine
from tests.gateway.harness import create_model, fwdbwd, model, new_key, session, wait_future

ENGINE_BACKEND = "mock"  # HTTP semantics only (tests/gateway/conftest.py)


@pytest.fixture(scope="module")
def env(make_gateway, each_db):
    with make_gateway(db=each_db) as gw:
        admin = gw.key("root", org="ops", scope="admin")
        yield {"c": gw.client, "db_url": gw.db_url, "admin": admin, "h": {"X-API-Key": admin}}


def _events(env, event: str) -> list[dict]:
    r = env["c"].get("/api/v1/admin/audit", params={"event": event}, headers=env["h"])
    assert r.status_code == 200, r.text
    return r.json()["entries"]


def test_orgs_users_keys_quotas_crud_with_audit(env) -> None:
    c, h = env["c"], env["h"]
    org = c.post("/api/v1/admin/orgs", json={"name": "acme"}, headers=h).json()
    assert c.post("/api/v1/admin/orgs", json={"name": "acme"}, headers=h).status_code == 409
    user = c.post("/api/v1/admin/users", json={"name": "carol", "org": "acme"}, headers=h).json()
    assert user["org_id"] == org["id"] and not user["disabled"]
    r = c.post("/api/v1/admin/keys", json={"user_id": user["id"], "name": "laptop"}, headers=h)
    assert r.status_code == 200, r.text
    created = r.json()
    key = created["key"]
    assert key.startswith("tml-") and created["prefix"] == key[:10]
    me = c.get("/api/v1/auth/apikey/me", headers={"X-API-Key": key}).json()
    assert me["details"]["org_details"]["name"] == "acme"
    listed = c.get("/api/v1/admin/keys", params={"user_id": user["id"]}, headers=h).text
    assert key not in listed and key[10:] not in listed and "digest" not in listed
    # bad input: 400 naming the field
    r = c.post("/api/v1/admin/keys", json={"user_id": user["id"], "scope": "root"}, headers=h)
    assert r.status_code == 400 and "scope" in r.json()["detail"]
    r = c.put(f"/api/v1/admin/quotas/org/{org['id']}", json={"limits": {"nope": 1}}, headers=h)
    assert r.status_code == 400 and "nope" in r.json()["detail"]
    # quotas: set, read, audited
    r = c.put(
        f"/api/v1/admin/quotas/org/{org['id']}",
        json={"limits": {"max_training_clients": 1, "max_lora_rank": 8}},
        headers=h,
    )
    assert r.json()["limits"] == {"max_training_clients": 1, "max_lora_rank": 8}
    r = c.put(
        f"/api/v1/admin/quotas/user/{user['id']}",
        json={"limits": {"max_training_clients": 5}},
        headers=h,
    )
    changed = [
        e
        for e in _events(env, "quota_changed")
        if e["event_details"]["subject"] == f"org:{org['id']}"
    ]
    assert {e["event_details"]["quota"] for e in changed} == {
        "max_training_clients",
        "max_lora_rank",
    }
    # the org cap (1) holds even though the user's own override is 5
    sid = session(c, key)
    assert create_model(c, key, sid, 0).status_code == 200
    r = create_model(c, key, sid, 1)
    assert r.status_code == 403 and "organization acme" in r.json()["detail"]
    usage = c.get(f"/api/v1/admin/users/{user['id']}/quota_usage", headers=h).json()
    assert usage["levels"]["org"]["max_training_clients"] == {"current": 1, "limit": 1}
    assert usage["levels"]["user"]["max_training_clients"] == {"current": 1, "limit": 5}
    assert _events(env, "key_created") and _events(env, "organization_created")


def test_disable_and_revoke_take_effect_on_the_next_request(env) -> None:
    c, h = env["c"], env["h"]
    key = new_key(env["db_url"], "dave", org="acme2")
    hk = {"X-API-Key": key}
    sid = session(c, key)
    users = c.get("/api/v1/admin/users", headers=h).json()["users"]
    dave = next(u for u in users if u["name"] == "dave")
    assert (
        c.patch(f"/api/v1/admin/users/{dave['id']}", json={"disabled": True}, headers=h).status_code
        == 200
    )
    r = c.post("/api/v1/session_heartbeat", json={"session_id": sid}, headers=hk)
    assert r.status_code == 401 and "disabled" in r.json()["detail"]
    c.patch(f"/api/v1/admin/users/{dave['id']}", json={"disabled": False}, headers=h)
    orgs = c.get("/api/v1/admin/orgs", headers=h).json()["orgs"]
    acme2 = next(o for o in orgs if o["name"] == "acme2")
    c.patch(f"/api/v1/admin/orgs/{acme2['id']}", json={"disabled": True}, headers=h)
    assert (
        c.post("/api/v1/session_heartbeat", json={"session_id": sid}, headers=hk).status_code == 401
    )
    c.patch(f"/api/v1/admin/orgs/{acme2['id']}", json={"disabled": False}, headers=h)
    assert (
        c.post("/api/v1/session_heartbeat", json={"session_id": sid}, headers=hk).status_code == 200
    )
    keys = c.get("/api/v1/admin/keys", params={"user_id": dave["id"]}, headers=h).json()["keys"]
    r = c.post(f"/api/v1/admin/keys/{keys[0]['id']}/revoke", headers=h)
    assert r.json()["revoked_at"]
    r = c.post("/api/v1/session_heartbeat", json={"session_id": sid}, headers=hk)
    assert r.status_code == 401 and "revoked" in r.json()["detail"]
    revoked = [
        e for e in _events(env, "key_revoked") if e["event_details"]["key_prefix"] == key[:10]
    ]
    assert revoked and revoked[0]["event_details"]["actor_user_id"]
    denied = _events(env, "access_denied")
    assert any(e["event_details"]["path"] == "/api/v1/session_heartbeat" for e in denied)
    # an expired key
    r = c.post(
        "/api/v1/admin/keys", json={"user_id": dave["id"], "expires_in_seconds": 1}, headers=h
    )
    eng = make_engine(env["db_url"])
    with eng.begin() as conn:  # move its expiry into the past instead of sleeping
        conn.execute(
            text("UPDATE api_keys SET expires_at = :t WHERE id = :i"),
            {
                "t": datetime.now(UTC).replace(tzinfo=None) - timedelta(seconds=1),
                "i": r.json()["id"],
            },
        )
    eng.dispose()
    r = c.get("/api/v1/auth/apikey/me", headers={"X-API-Key": r.json()["key"]})
    assert r.status_code == 401 and "expired" in r.json()["detail"]


def test_usage_ledger_and_engine_status(env) -> None:
    c, h = env["c"], env["h"]
    key = new_key(env["db_url"], "erin", org="acme3")
    sid = session(c, key)
    mid = model(c, key, sid)
    for seq in (1, 2):
        assert wait_future(c, key, fwdbwd(c, key, mid, seq, 12).json()).status_code == 200
    r = c.post(
        "/api/v1/asample",
        headers={"X-API-Key": key},
        json={
            "base_model": "twinkle/tiny-chat",
            "num_samples": 1,
            "prompt": {"chunks": [{"type": "encoded_text", "tokens": [5, 6, 7]}]},
            "sampling_params": {"max_tokens": 3, "temperature": 0},
        },
    )
    wait_future(c, key, r.json())
    now = datetime.now(UTC)
    params = {
        "start": (now - timedelta(hours=1)).isoformat(),
        "end": (now + timedelta(hours=1)).isoformat(),
    }
    buckets = c.get("/api/v1/admin/usage", params=params, headers=h).json()["buckets"]
    uid = next(b["user_id"] for b in buckets if b["session_id"] == sid)
    by_kind = {b["kind"]: b["quantity"] for b in buckets if b["user_id"] == uid}
    assert by_kind["training"] == 24
    assert by_kind["sampling_prefill"] == 3 and 1 <= by_kind["sampling_sample"] <= 3
    # checkpoint storage accrues GB-hours: kept bytes x hours since the last accrual
    save = c.post(
        "/api/v1/save_weights",
        headers={"X-API-Key": key},
        json={"model_id": mid, "seq_id": 3, "path": "ck"},
    ).json()
    assert wait_future(c, key, save)["path"]
    ledger = services_of(c.app).usage
    t0 = datetime.now(UTC).replace(tzinfo=None, minute=0, second=0, microsecond=0)
    ledger._last_accrual = None
    ledger.accrue_storage(t0)
    ledger.accrue_storage(t0 + timedelta(hours=2))
    ckpts = c.get("/api/v1/checkpoints", headers={"X-API-Key": key}).json()["checkpoints"]
    size = sum(x["size_bytes"] for x in ckpts)
    params = {
        "start": (t0 - timedelta(hours=3)).isoformat(),
        "end": (t0 + timedelta(hours=3)).isoformat(),
        "user_id": uid,
    }
    storage = [
        b
        for b in c.get("/api/v1/admin/usage", params=params, headers=h).json()["buckets"]
        if b["kind"] == "storage"
    ]
    assert size > 0 and sum(b["gigabyte_hours"] for b in storage) == pytest.approx(size / 1e9 * 2)
    status = c.get("/api/v1/admin/engine", headers=h).json()["models"]["twinkle/tiny-chat"]
    assert status["trainer"]["pool"] and "queued" in status["trainer"]


def test_raw_keys_never_appear_in_responses_logs_or_the_database(
    env, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    c, h = env["c"], env["h"]
    key = new_key(env["db_url"], "frank", org="acme4")
    texts: list[str] = []

    def call(method: str, url: str, **kw) -> None:
        r = c.request(method, url, **kw)
        texts.append(r.text + repr(dict(r.headers)))

    hk = {"X-API-Key": key}
    call("POST", "/api/v1/create_session", json={}, headers=hk)
    call("POST", "/api/v1/create_session", json={}, headers={"X-API-Key": key + "x"})
    call("POST", "/api/v1/create_session", json={}, headers={"Authorization": f"Bearer {key}"})
    call("GET", "/api/v1/admin/orgs", headers=hk)  # denied: audited
    call("GET", "/api/v1/admin/keys", headers=h)
    call("GET", "/api/v1/admin/audit", headers=h)
    users = c.get("/api/v1/admin/users", headers=h).json()["users"]
    frank = next(u for u in users if u["name"] == "frank")
    keys = c.get("/api/v1/admin/keys", params={"user_id": frank["id"]}, headers=h).json()["keys"]
    call("POST", f"/api/v1/admin/keys/{keys[0]['id']}/revoke", headers=h)
    call("POST", "/api/v1/create_session", json={}, headers=hk)  # revoked
    metrics = c.get("/metrics").text  # labels are route templates: never a key
    assert 'route="/api/v1/create_session",status="401"' in metrics
    texts.append(metrics)
    eng = make_engine(env["db_url"])
    try:
        with eng.connect() as conn:
            tables = sa.inspect(conn).get_table_names()
            dump = " ".join(
                str(v)
                for t in tables
                for row in conn.exec_driver_sql(f'SELECT * FROM "{t}"')
                for v in row
            )
    finally:
        eng.dispose()
    secrets_ = [key, key[10:], env["admin"], env["admin"][10:]]
    assert key[:10] in dump  # the display prefix is there, so the dump is not empty
    for s in secrets_:
        assert s not in dump
        assert s not in caplog.text
        assert all(s not in t for t in texts)


def test_access_denied_audit_is_throttled(env, monkeypatch: pytest.MonkeyPatch) -> None:
    import gateway.accounts.audit as audit

    monkeypatch.setattr(audit, "DENIED_PER_MINUTE", 3)
    monkeypatch.setattr(audit, "_denied_window", {"minute": 0, "count": 0})
    c = env["c"]
    before = len(_events(env, "access_denied"))
    for _ in range(10):
        r = c.get("/api/v1/get_server_capabilities", headers={"X-API-Key": "tml-flood"})
        assert r.status_code == 401
    after = _events(env, "access_denied")
    assert len(after) - before == 3
    assert after[-1]["event_details"]["path"] == "/api/v1/get_server_capabilities"
