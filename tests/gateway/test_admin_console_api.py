"""What the admin console (admin_ui/) needs from the admin REST API, through the real gateway (real
SQLite and Postgres, in-process engine on the tiny model): ``whoami`` (the console's sign-in:
403 for a non-admin key), ``overview`` (models, queues, cumulative tokens and requests that the
console turns into rates), the engine's per-adapter states and owners, key listing by prefix,
audit paging (offset, newest first, total) and an organization's quota usage."""

from __future__ import annotations

import pytest

from tests.gateway.harness import BASE, fwdbwd, model, session, wait_future

ENGINE_BACKEND = "mock"  # HTTP semantics only (tests/gateway/conftest.py)


@pytest.fixture(scope="module")
def env(make_gateway, each_db):
    with make_gateway(db=each_db) as gw:
        admin = gw.key("root", org="ops", scope="admin")
        yield {"gw": gw, "c": gw.client, "h": {"X-API-Key": admin}, "admin": admin}


def _get(env, path: str, **params) -> dict:
    r = env["c"].get(f"/api/v1/admin{path}", params=params, headers=env["h"])
    assert r.status_code == 200, r.text
    return r.json()


def test_whoami_is_the_sign_in_check(env) -> None:
    c = env["c"]
    me = _get(env, "/whoami")
    assert me["user"] == "root" and me["org"] == "ops" and me["scope"] == "admin"
    assert me["key_prefix"] == env["admin"][:10]
    user_key = env["gw"].key("plain", org="acme")
    r = c.get("/api/v1/admin/whoami", headers={"X-API-Key": user_key})
    assert r.status_code == 403 and "admin" in r.json()["detail"]
    assert c.get("/api/v1/admin/whoami", headers={"X-API-Key": "tml-nope"}).status_code == 401


def test_overview_counts_tokens_requests_and_adapters(env) -> None:
    c = env["c"]
    key = env["gw"].key("olga", org="acme")
    before = _get(env, "/overview")
    assert [m["name"] for m in before["models"]] == [BASE]
    row = before["models"][0]
    assert row["trainer_replicas"] == row["sampler_replicas"] == 1 and row["error"] is None
    assert row["execution"] == "sequential"  # the harness configures it (no start-up probe)
    mid = model(c, key, session(c, key))
    for seq in (1, 2):
        assert wait_future(c, key, fwdbwd(c, key, mid, seq, 12).json()).status_code == 200
    # a 404 answered by this replica counts as a client error, never as a server error
    assert c.get("/api/v1/admin/users/999999/quota_usage", headers=env["h"]).status_code == 404
    after = _get(env, "/overview")
    assert after["tokens_total"]["training"] - before["tokens_total"]["training"] == 24
    assert after["tokens_total"]["sampling"] == before["tokens_total"]["sampling"]
    assert after["requests"]["total"] > before["requests"]["total"]
    assert after["requests"]["client_errors"] >= before["requests"]["client_errors"] + 1
    assert after["requests"]["server_errors"] == before["requests"]["server_errors"] == 0
    assert after["active_tenants"]["last_hour"] >= 1
    m = after["models"][0]
    assert m["adapters_loaded"] == row["adapters_loaded"] + 1
    assert after["queue"]["training_jobs"] == m["training_jobs_queued"] == 0  # all done
    # the engine page: each adapter with its owner (the tenant is the owner's user id)
    olga = next(u for u in _get(env, "/users")["users"] if u["name"] == "olga")
    trainer = _get(env, "/engine")["models"][BASE]["trainer"]
    assert {"model_id": mid, "tenant": str(olga["id"]), "state": "loaded"} in trainer["adapters"]
    assert trainer["queue"] == []


def test_keys_by_prefix(env) -> None:
    c, h = env["c"], env["h"]
    users = _get(env, "/users")["users"]
    uid = users[0]["id"]
    made = [c.post("/api/v1/admin/keys", json={"user_id": uid}, headers=h).json() for _ in "ab"]
    listed = _get(env, "/keys", prefix=made[0]["prefix"])["keys"]
    assert [k["id"] for k in listed] == [made[0]["id"]]
    assert len(_get(env, "/keys", prefix="tml-")["keys"]) >= 2
    # LIKE wildcards in the filter are plain characters
    assert _get(env, "/keys", prefix="tml%")["keys"] == []
    assert _get(env, "/keys", prefix="tml_")["keys"] == []


def test_audit_pages_newest_first_with_the_total(env) -> None:
    c, h = env["c"], env["h"]
    org = c.post("/api/v1/admin/orgs", json={"name": "pager"}, headers=h).json()
    for value in range(1, 8):  # 7 quota_changed events for this org, values 1..7
        r = c.put(
            f"/api/v1/admin/quotas/org/{org['id']}",
            json={"limits": {"max_checkpoints": value}},
            headers=h,
        )
        assert r.status_code == 200, r.text
    q = {"event": "quota_changed", "org_id": org["id"], "newest_first": True, "limit": 3}
    pages = [_get(env, "/audit", **q, offset=o) for o in (0, 3, 6)]
    assert {p["total"] for p in pages} == {7}
    values = [e["event_details"]["new"] for p in pages for e in p["entries"]]
    assert values == [7, 6, 5, 4, 3, 2, 1]
    oldest = _get(env, "/audit", event="quota_changed", org_id=org["id"], limit=2)
    assert [e["event_details"]["new"] for e in oldest["entries"]] == [1, 2]
    r = c.get("/api/v1/admin/audit", params={"offset": -1}, headers=h)
    assert r.status_code == 400 and "offset" in r.json()["detail"]


def test_org_quota_usage(env) -> None:
    c, h = env["c"], env["h"]
    org = c.post("/api/v1/admin/orgs", json={"name": "capped"}, headers=h).json()
    key = env["gw"].key("cap-user", org="capped")
    c.put(
        f"/api/v1/admin/quotas/org/{org['id']}",
        json={"limits": {"max_training_clients": 3}},
        headers=h,
    )
    model(c, key)
    levels = _get(env, f"/orgs/{org['id']}/quota_usage")["levels"]
    assert list(levels) == ["org"]
    assert levels["org"]["max_training_clients"] == {"current": 1, "limit": 3}
    r = c.get("/api/v1/admin/orgs/999999/quota_usage", headers=h)
    assert r.status_code == 404 and "org_id" in r.json()["detail"]
