"""Credentials cannot renew themselves, through the real gateway app (JWT mode, real SQLite):
only the API key itself is exchanged for a JWT at POST /api/v1/auth/token or mints an API key at
POST /api/v1/admin/keys, whichever header carries the credential; a JWT still authenticates
every other route until it expires."""

from __future__ import annotations

import pytest

ENGINE_BACKEND = "mock"  # HTTP semantics only (tests/gateway/conftest.py)

HEADERS = [
    lambda t: {"X-API-Key": t},
    lambda t: {"Authorization": f"Bearer {t}"},
    lambda t: {"Twinkle-Authorization": f"Bearer {t}"},
]


@pytest.fixture(scope="module")
def gw(make_gateway):
    return make_gateway(gateway={"jwt_enabled": True, "jwt_ttl_seconds": 300})


def _jwt(gw, key: str) -> str:
    r = gw.client.post("/api/v1/auth/token", json={}, headers={"X-API-Key": key})
    assert r.status_code == 200, r.text
    return r.json()["jwt"]


@pytest.mark.parametrize("header", HEADERS, ids=["x-api-key", "authorization", "twinkle-auth"])
def test_only_the_api_key_is_exchanged_for_a_jwt(gw, header) -> None:
    key = gw.key("minter")
    r = gw.client.post("/api/v1/auth/token", json={}, headers=header(key))
    assert r.status_code == 200, r.text
    jwt = r.json()["jwt"]
    assert jwt.startswith("eyJ")
    # the JWT authenticates ordinary routes in the same header...
    me = gw.client.get("/api/v1/auth/apikey/me", headers=header(jwt))
    assert me.status_code == 200 and me.json()["name"] == key[:10]
    # ...but buys no successor
    again = gw.client.post("/api/v1/auth/token", json={}, headers=header(jwt))
    assert again.status_code == 403, again.text
    assert "jwt" not in again.json()


def test_an_admin_jwt_mints_no_api_key(gw) -> None:
    admin = gw.key("root", org="ops", scope="admin")
    user = gw.client.post(
        "/api/v1/admin/users", json={"name": "carol"}, headers={"X-API-Key": admin}
    ).json()
    body = {"user_id": user["id"], "scope": "admin"}
    jwt = _jwt(gw, admin)
    assert gw.client.get("/api/v1/admin/keys", headers={"X-API-Key": jwt}).status_code == 200
    for header in HEADERS:
        r = gw.client.post("/api/v1/admin/keys", json=body, headers=header(jwt))
        assert r.status_code == 403 and "key" not in r.json(), r.text
    r = gw.client.post("/api/v1/admin/keys", json=body, headers={"X-API-Key": admin})
    assert r.status_code == 200 and r.json()["key"].startswith("tml-")
    # the refusals are audited, with the JWT's key prefix and without the JWT
    audit = gw.client.get(
        "/api/v1/admin/audit", params={"event": "access_denied"}, headers={"X-API-Key": admin}
    ).text
    assert "a JWT may not mint credentials" in audit and admin[:10] in audit
    assert jwt not in audit
