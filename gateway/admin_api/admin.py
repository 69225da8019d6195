"""The admin REST API under ``/api/v1/admin`` (admin-scope keys only, via `AdminPrincipalDep`):
organizations, users and keys (create / list / update / disable / revoke), the audit log and live
engine status. Quotas and usage are in `gateway.admin_api.admin_quotas`. Every change writes an
audit event in the same transaction."""

from __future__ import annotations

import asyncio
from datetime import datetime

from fastapi import APIRouter, Depends, Query
from pydantic import BaseModel, ConfigDict, Field
from sqlmodel import col, select

from gateway.accounts.audit import count_events, event_json, list_events, record_event
from gateway.accounts.keys import AdminPrincipalDep, get_key_principal
from gateway.accounts.service import (
    clean_name,
    create_key,
    ensure_org,
    ensure_user,
    key_json,
    revoke_key,
)
from gateway.db.tables import ApiKeyRow, OrganizationRow, UserRow, utcnow
from gateway.deps import (
    DB_INT_MAX,
    MAX_TTL_S,
    ROW_ID_MAX,
    ConfigDep,
    DbDep,
    EngineDep,
    PathRowId,
    QueryRowId,
)
from gateway.errors import ConflictError, NotFoundError

router = APIRouter(prefix="/api/v1/admin", tags=["admin"])


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class OrgCreate(_Body):
    name: str = Field(min_length=1, max_length=128)


class DisableUpdate(_Body):
    disabled: bool


class UserCreate(_Body):
    name: str = Field(min_length=1, max_length=128)
    org: str | None = Field(default=None, max_length=128)
    admin: bool = False


class KeyCreate(_Body):
    # beyond a row id no user can exist, and the DB driver would raise (a 500 schemathesis
    # found with user_id 1247877986610329089400941576192)
    user_id: int = Field(ge=0, le=ROW_ID_MAX)
    scope: str = "user"
    name: str | None = Field(default=None, max_length=128)
    expires_in_seconds: int | None = Field(default=None, gt=0, le=MAX_TTL_S)


def _iso(ts: datetime | None) -> str | None:
    return None if ts is None else ts.isoformat() + "Z"


def org_json(o: OrganizationRow) -> dict:
    return {
        "id": o.id,
        "name": o.name,
        "created_at": _iso(o.created_at),
        "disabled": o.disabled_at is not None,
    }


def user_json(u: UserRow) -> dict:
    return {
        "id": u.id,
        "name": u.name,
        "org_id": u.org_id,
        "is_admin": u.is_admin,
        "created_at": _iso(u.created_at),
        "disabled": u.disabled_at is not None,
    }


# -- organizations ---------------------------------------------------------------------------
@router.get("/orgs")
async def list_orgs(who: AdminPrincipalDep, db: DbDep) -> dict:
    return {
        "orgs": [
            org_json(o) for o in db.exec(select(OrganizationRow).order_by(col(OrganizationRow.id)))
        ]
    }


@router.post("/orgs")
async def create_org(body: OrgCreate, who: AdminPrincipalDep, db: DbDep) -> dict:
    name = clean_name(body.name, "name")
    if db.exec(select(OrganizationRow).where(OrganizationRow.name == name)).first():
        raise ConflictError(f"name: organization {name!r} already exists")
    org = ensure_org(db, name)
    db.commit()
    return org_json(org)


def _org(db, org_id: int) -> OrganizationRow:
    org = db.get(OrganizationRow, org_id)
    if org is None:
        raise NotFoundError(f"org_id: organization {org_id} not found")
    return org


@router.patch("/orgs/{org_id}")
async def update_org(
    org_id: PathRowId, body: DisableUpdate, who: AdminPrincipalDep, db: DbDep
) -> dict:
    org = _org(db, org_id)
    org.disabled_at = utcnow() if body.disabled else None
    db.add(org)
    record_event(
        db,
        "organization_updated",
        org_id=org.id,
        actor_user_id=who.user_id,
        actor_key_prefix=who.key_prefix,
        details={"disabled": body.disabled},
    )
    db.commit()
    return org_json(org)


# -- users -----------------------------------------------------------------------------------
@router.get("/users")
async def list_users(who: AdminPrincipalDep, db: DbDep, org_id: QueryRowId = None) -> dict:
    q = select(UserRow).order_by(col(UserRow.id))
    if org_id is not None:
        q = q.where(UserRow.org_id == org_id)
    return {"users": [user_json(u) for u in db.exec(q)]}


@router.post("/users")
async def create_user(body: UserCreate, who: AdminPrincipalDep, db: DbDep) -> dict:
    name = clean_name(body.name, "name")
    if db.exec(select(UserRow).where(UserRow.name == name)).first():
        raise ConflictError(f"name: user {name!r} already exists")
    user = ensure_user(db, name, org_name=body.org, admin=body.admin)
    db.commit()
    return user_json(user)


def _user(db, user_id: int) -> UserRow:
    user = db.get(UserRow, user_id)
    if user is None:
        raise NotFoundError(f"user_id: user {user_id} not found")
    return user


@router.patch("/users/{user_id}")
async def update_user(
    user_id: PathRowId, body: DisableUpdate, who: AdminPrincipalDep, db: DbDep
) -> dict:
    user = _user(db, user_id)
    user.disabled_at = utcnow() if body.disabled else None
    db.add(user)
    record_event(
        db,
        "user_updated",
        org_id=user.org_id,
        actor_user_id=who.user_id,
        actor_key_prefix=who.key_prefix,
        details={"user": user.name, "disabled": body.disabled},
    )
    db.commit()
    return user_json(user)


# -- keys ------------------------------------------------------------------------------------
@router.get("/keys")
async def list_keys(
    who: AdminPrincipalDep,
    db: DbDep,
    user_id: QueryRowId = None,
    prefix: str | None = Query(None, max_length=64, description="keys whose prefix starts so"),
) -> dict:
    q = select(ApiKeyRow, UserRow).join(UserRow, col(UserRow.id) == ApiKeyRow.user_id)
    if user_id is not None:
        q = q.where(ApiKeyRow.user_id == user_id)
    if prefix:
        q = q.where(col(ApiKeyRow.prefix).startswith(prefix, autoescape=True))
    return {"keys": [key_json(k, u) for k, u in db.exec(q.order_by(col(ApiKeyRow.id)))]}


@router.post("/keys", dependencies=[Depends(get_key_principal)])  # a JWT mints no API key
async def create_api_key(body: KeyCreate, who: AdminPrincipalDep, db: DbDep) -> dict:
    user = _user(db, body.user_id)
    key, row = create_key(
        db,
        body.user_id,
        scope=body.scope,
        name=body.name,
        expires_in_s=body.expires_in_seconds,
        actor_user_id=who.user_id,
    )
    db.commit()
    return {**key_json(row, user), "key": key}


@router.post("/keys/{key_id}/revoke")
async def revoke_api_key(key_id: PathRowId, who: AdminPrincipalDep, db: DbDep) -> dict:
    row = db.get(ApiKeyRow, key_id)
    if row is None:
        raise NotFoundError(f"key_id: key {key_id} not found")
    revoke_key(db, row, actor_user_id=who.user_id)
    db.commit()
    return key_json(row, db.get(UserRow, row.user_id))


# -- audit and engine ------------------------------------------------------------------------
@router.get("/audit")
async def admin_audit(
    who: AdminPrincipalDep,
    db: DbDep,
    start: datetime | None = None,
    end: datetime | None = None,
    org_id: QueryRowId = None,
    event: list[str] | None = Query(None),
    limit: int = Query(1000, ge=1, le=10000),
    offset: int = Query(0, ge=0, le=DB_INT_MAX),
    newest_first: bool = False,
) -> dict:
    """One page of the filtered log (``limit`` entries after ``offset``) and the filtered total."""
    filters = {"org_id": org_id, "start": start, "end": end, "events": event}
    rows = list_events(db, **filters, limit=limit, offset=offset, newest_first=newest_first)
    return {"entries": [event_json(r) for r in rows], "total": count_events(db, **filters)}


@router.get("/engine")
async def engine_status(who: AdminPrincipalDep, config: ConfigDep, engine: EngineDep) -> dict:
    """Per base model: the Trainer's adapters, queues and execution mode, the Sampler's stats."""
    out = {}
    for m in config.models:
        entry: dict = {}
        for role in ("trainer", "sampler"):
            replica = engine.trainer(m.name) if role == "trainer" else engine.sampler(m.name)
            try:
                entry[role] = await asyncio.wait_for(replica.stats(), timeout=5)
            except Exception as exc:  # a replica that does not answer is reported, not fatal
                entry[role] = {"error": type(exc).__name__}
        out[m.name] = entry
    return {"models": out}
