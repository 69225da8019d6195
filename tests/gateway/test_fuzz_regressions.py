"""Inputs at the edges of the DB's types, through the real gateway and DB (fast companions of
tests/e2e/test_fuzz_api.py): integers beyond a 64-bit DB column in a path or query string would be
OverflowErrors in the driver (500), and so would an expiry beyond what a datetime holds;
validation refuses them with a 400 naming the parameter, before any query."""

from __future__ import annotations

import pytest

ENGINE_BACKEND = "mock"  # HTTP semantics only (tests/gateway/conftest.py)

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


def test_a_key_for_a_user_id_beyond_a_row_id_is_a_400(env) -> None:
    """POST /admin/keys with user_id 1247877986610329089400941576192 reached the DB lookup and
    overflowed the driver (a 500, schemathesis in CI 2026-12-06); out of range is a 400 naming the
    field, a user id in range that does not exist a 404."""
    client, headers = env
    r = client.post("/api/v1/admin/keys", json={"user_id": int(BIG)}, headers=headers)
    assert r.status_code == 400 and "user_id" in r.json()["detail"], r.text
    r = client.post("/api/v1/admin/keys", json={"user_id": 2**31 - 1}, headers=headers)
    assert r.status_code == 404 and "user_id" in r.json()["detail"], r.text
    assert client.get("/api/v1/healthz").status_code == 200


# -- Postgres enforces what SQLite does not (32-bit INTEGER ids, VARCHAR lengths, no NUL in
# text); unvalidated, each would be a 500 there
ID_32 = str(2**31)


@pytest.fixture(scope="module")
def pg(make_gateway):
    with make_gateway(db="postgres") as gw:
        yield gw.client, gw, {"X-API-Key": gw.key("root", scope="admin")}


@pytest.mark.parametrize(
    ("method", "path", "field"),
    [
        ("GET", f"/api/v1/admin/users?org_id={ID_32}", "org_id"),
        ("GET", f"/api/v1/admin/keys?user_id={ID_32}", "user_id"),
        ("GET", f"/api/v1/admin/audit?org_id={ID_32}", "org_id"),
        ("GET", f"/api/v1/admin/usage?user_id={ID_32}", "user_id"),
        ("GET", f"/api/v1/admin/orgs/{ID_32}/quota_usage", "org_id"),
        ("GET", f"/api/v1/admin/users/{ID_32}/quota_usage", "user_id"),
    ],
)
def test_ids_past_32_bits_are_a_400_on_postgres(pg, method, path, field) -> None:
    client, _, headers = pg
    r = client.request(method, path, headers=headers)
    assert r.status_code == 400 and field in r.json()["detail"], (r.status_code, r.text)


def test_a_key_for_a_user_id_past_32_bits_is_a_400_on_postgres(pg) -> None:
    client, _, headers = pg
    r = client.post("/api/v1/admin/keys", json={"user_id": 2**31}, headers=headers)
    assert r.status_code == 400 and "user_id" in r.json()["detail"], r.text


def test_a_signed_download_with_a_32_bit_plus_id_is_a_404_on_postgres(pg) -> None:
    client, _, _ = pg
    r = client.get(f"/api/v1/external_weights/{2**61}/x?sig=ab&expires=1")
    assert r.status_code == 404, r.text


def test_a_nul_byte_reaching_postgres_is_a_400_and_the_server_keeps_serving(pg) -> None:
    client, gw, _ = pg
    h = {"X-API-Key": gw.key("nul")}
    r = client.post(
        "/api/v1/save_weights_for_sampler", headers=h, json={"model_id": "a\u0000b", "seq_id": 1}
    )
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "invalid_request"
    assert "NUL" in r.json()["detail"], r.text
    assert client.get("/api/v1/healthz").status_code == 200
    assert client.post("/api/v1/create_session", headers=h, json={}).status_code == 200


def test_session_strings_fit_their_columns_on_postgres(pg) -> None:
    """A long client version is kept in part (it is informational); a project id or display
    name past its column is a 400 naming it."""
    client, gw, _ = pg
    h = {"X-API-Key": gw.key("strings")}
    r = client.post("/api/v1/twinkle/create_session", headers=h, json={"client_version": "0" * 31})
    assert r.status_code == 200, r.text
    r = client.post("/api/v1/create_session", headers=h, json={"sdk_version": "9" * 40})
    assert r.status_code == 200, r.text
    for field, n in (("project_id", 129), ("display_name", 257)):
        r = client.post("/api/v1/create_session", headers=h, json={field: "p" * n})
        assert r.status_code == 400 and field in r.json()["detail"], r.text
