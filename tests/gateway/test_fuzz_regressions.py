"""5xx found by fuzzing the API (tests/e2e/test_fuzz_api.py), each kept here as a fast regression
check through the real gateway and DB: integers beyond a 64-bit DB column in a path or query
string were OverflowErrors in the driver (500), and so was an expiry beyond what a datetime holds;
now validation refuses them with a 400 naming the parameter, before any query."""

from __future__ import annotations

import pytest

BIG = str(2**64 + 7)


@pytest.fixture(scope="module")
def env(make_gateway):
    with make_gateway() as gw:
        yield gw.client, {"X-API-Key": gw.key("root", scope="admin")}


@pytest.mark.parametrize(
    ("method", "path", "field"),
    [
        ("GET", f"/api/v1/checkpoints?offset={BIG}", "offset"),
        ("GET", f"/api/v1/sessions?offset={BIG}", "offset"),
        ("GET", f"/api/v1/training_runs?offset={BIG}", "offset"),
        ("GET", f"/api/v1/admin/users?org_id=-{BIG}", "org_id"),
        ("GET", f"/api/v1/admin/keys?user_id={BIG}", "user_id"),
        ("GET", f"/api/v1/admin/audit?org_id={BIG}", "org_id"),
        ("GET", f"/api/v1/admin/audit?offset={BIG}", "offset"),
        ("GET", f"/api/v1/admin/orgs/{BIG}/quota_usage", "org_id"),
        ("GET", f"/api/v1/admin/usage?user_id={BIG}", "user_id"),
        ("GET", f"/api/v1/admin/users/{BIG}/quota_usage", "user_id"),
        ("GET", f"/api/v1/admin/quotas/user/{BIG}", "subject_id"),
        ("POST", f"/api/v1/admin/keys/{BIG}/revoke", "key_id"),
    ],
)
def test_out_of_range_integers_are_a_400_naming_the_parameter(env, method, path, field) -> None:
    client, headers = env
    r = client.request(method, path, headers=headers)
    assert r.status_code == 400, (r.status_code, r.text)
    assert field in r.json()["detail"]
    assert client.get("/api/v1/healthz").status_code == 200


def test_expiry_beyond_ten_years_is_a_400(env) -> None:
    """A key's expires_in_seconds of 2.9e20 overflowed the expiry datetime (a 500); TTLs of
    checkpoint saves share the bound."""
    client, headers = env
    users = client.get("/api/v1/admin/users", headers=headers).json()["users"]
    body = {"user_id": users[0]["id"], "expires_in_seconds": 289171298188670894080}
    r = client.post("/api/v1/admin/keys", json=body, headers=headers)
    assert r.status_code == 400 and "expires_in_seconds" in r.json()["detail"], r.text
    body["expires_in_seconds"] = 3600
    assert client.post("/api/v1/admin/keys", json=body, headers=headers).status_code == 200


def test_a_key_for_a_user_id_beyond_64_bits_is_a_400(env) -> None:
    """POST /admin/keys with user_id 1247877986610329089400941576192 reached the DB lookup and
    overflowed the driver (a 500, schemathesis in CI 2026-12-06); out of range is a 400 naming the
    field, a user id in range that does not exist a 404."""
    client, headers = env
    r = client.post("/api/v1/admin/keys", json={"user_id": int(BIG)}, headers=headers)
    assert r.status_code == 400 and "user_id" in r.json()["detail"], r.text
    r = client.post("/api/v1/admin/keys", json={"user_id": 2**63 - 1}, headers=headers)
    assert r.status_code == 404 and "user_id" in r.json()["detail"], r.text
    assert client.get("/api/v1/healthz").status_code == 200
