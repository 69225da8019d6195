"""``POST /api/v1/auth/token`` (the Tinker SDK's JWT exchange, when ``gateway.jwt_enabled``) and
``GET|DELETE /api/v1/auth/apikey/me`` (``tinker auth login`` / ``logout``)."""

from __future__ import annotations

from fastapi import APIRouter

from gateway.accounts.keys import KeyPrincipalDep, PrincipalDep
from gateway.accounts.service import revoke_key
from gateway.context import ServicesDep
from gateway.db.tables import ApiKeyRow
from gateway.deps import DbDep
from gateway.errors import NotFoundError

router = APIRouter(prefix="/api/v1/auth")


@router.post("/token")
async def auth_token(who: KeyPrincipalDep, services: ServicesDep) -> dict:
    """A JWT for the caller's API key. Only the key itself is exchanged, whichever header carries
    it: a JWT that could mint its successor would live, by chained renewals, as long as its key
    (the SDK refreshes with its API key, so it never sends a JWT here)."""
    issuer = services.jwt
    if issuer is None:
        raise NotFoundError("JWT auth is not enabled on this server (gateway.jwt_enabled)")
    jwt = issuer.mint(user_id=who.user_id, org_id=who.org_id, key_id=who.key_id, scope=who.scope)
    return {"jwt": jwt}


def _me(db, who) -> ApiKeyRow:
    row = db.get(ApiKeyRow, who.key_id)
    if row is None:
        raise NotFoundError("API key not found")
    return row


@router.get("/apikey/me")
async def get_my_key(who: PrincipalDep, db: DbDep) -> dict:
    row = _me(db, who)
    return {
        "key_id": row.id,
        "name": row.name or row.prefix,
        "note": f"{row.scope} key {row.prefix}...",
        "details": {
            "org_details": {"name": who.org_name or ""},
            "user_details": {"email": who.user_name},
        },
    }


@router.delete("/apikey/me")
async def delete_my_key(who: PrincipalDep, db: DbDep) -> dict:
    row = _me(db, who)
    revoke_key(db, row, actor_user_id=who.user_id)
    db.commit()
    return {"revoked": row.prefix}
