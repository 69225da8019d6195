"""Admin API for quotas and usage: ``/api/v1/admin/quotas/{org|user}/{id}`` (read / change limits,
audited as ``quota_changed``), ``/api/v1/admin/users/{id}/quota_usage`` and
``/api/v1/admin/orgs/{id}/quota_usage`` (live use vs limits) and ``/api/v1/admin/usage`` (the
hourly ledger)."""

from __future__ import annotations

from datetime import datetime

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict

from gateway.accounts.audit import record_event
from gateway.accounts.keys import AdminPrincipalDep, Principal
from gateway.accounts.usage import query
from gateway.db.tables import OrganizationRow, UserRow
from gateway.deps import DbDep, PathRowId, QueryRowId
from gateway.errors import InvalidRequestError, NotFoundError
from gateway.quotas import QuotasDep
from gateway.quotas.limits import QUOTAS, SUBJECT_TYPES, limits_of, set_limit

router = APIRouter(prefix="/api/v1/admin", tags=["admin"])


class QuotaUpdate(BaseModel):
    model_config = ConfigDict(extra="forbid")
    limits: dict[str, int | None]


def _subject(db, subject_type: str, subject_id: int) -> int | None:
    """The org id the subject belongs to (404 if the subject does not exist)."""
    if subject_type not in SUBJECT_TYPES:
        raise InvalidRequestError(f"subject_type: must be one of {list(SUBJECT_TYPES)}")
    if subject_type == "org":
        if db.get(OrganizationRow, subject_id) is None:
            raise NotFoundError(f"org_id: organization {subject_id} not found")
        return subject_id
    user = db.get(UserRow, subject_id)
    if user is None:
        raise NotFoundError(f"user_id: user {subject_id} not found")
    return user.org_id


@router.get("/quotas")
async def quota_names(who: AdminPrincipalDep) -> dict:
    return {"quotas": QUOTAS}


@router.get("/quotas/{subject_type}/{subject_id}")
async def get_quotas(
    subject_type: str, subject_id: PathRowId, who: AdminPrincipalDep, db: DbDep
) -> dict:
    _subject(db, subject_type, subject_id)
    return {
        "subject_type": subject_type,
        "subject_id": subject_id,
        "limits": limits_of(db, subject_type, subject_id),
    }


@router.put("/quotas/{subject_type}/{subject_id}")
async def put_quotas(
    subject_type: str, subject_id: PathRowId, body: QuotaUpdate, who: AdminPrincipalDep, db: DbDep
) -> dict:
    org_id = _subject(db, subject_type, subject_id)
    for name, value in body.limits.items():
        old, new = set_limit(db, subject_type, subject_id, name, value)
        if old != new:
            record_event(
                db,
                "quota_changed",
                org_id=org_id,
                actor_user_id=who.user_id,
                actor_key_prefix=who.key_prefix,
                details={
                    "subject": f"{subject_type}:{subject_id}",
                    "quota": name,
                    "old": old,
                    "new": new,
                },
            )
    db.commit()
    return {
        "subject_type": subject_type,
        "subject_id": subject_id,
        "limits": limits_of(db, subject_type, subject_id),
    }


@router.get("/users/{user_id}/quota_usage")
async def quota_usage(
    user_id: PathRowId, who: AdminPrincipalDep, db: DbDep, quotas: QuotasDep
) -> dict:
    user = db.get(UserRow, user_id)
    if user is None:
        raise NotFoundError(f"user_id: user {user_id} not found")
    org = db.get(OrganizationRow, user.org_id) if user.org_id is not None else None
    subject = Principal(
        user_id=user_id,
        user_name=user.name,
        scope="user",
        key_id=0,
        org_id=user.org_id,
        org_name=org.name if org else None,
    )
    return {"user_id": user_id, "org_id": user.org_id, "levels": await quotas.usage(subject, db)}


@router.get("/orgs/{org_id}/quota_usage")
async def org_quota_usage(
    org_id: PathRowId, who: AdminPrincipalDep, db: DbDep, quotas: QuotasDep
) -> dict:
    """The organization level alone: all its users' use together against the org's limits."""
    org = db.get(OrganizationRow, org_id)
    if org is None:
        raise NotFoundError(f"org_id: organization {org_id} not found")
    # user 0 never exists: only the org level of its answer is used
    subject = Principal(
        user_id=0, user_name="", scope="user", key_id=0, org_id=org_id, org_name=org.name
    )
    levels = await quotas.usage(subject, db)
    return {"org_id": org_id, "levels": {"org": levels["org"]}}


@router.get("/usage")
async def usage(
    who: AdminPrincipalDep,
    db: DbDep,
    start: datetime,
    end: datetime,
    org_id: QueryRowId = None,
    user_id: QueryRowId = None,
) -> dict:
    rows = query(
        db,
        org_id=org_id,
        start=start.replace(tzinfo=None),
        end=end.replace(tzinfo=None),
        user_id=user_id,
    )
    return {
        "buckets": [
            {
                "bucket_start": r.bucket_start.isoformat() + "Z",
                "org_id": r.org_id,
                "user_id": r.user_id,
                "session_id": r.session_id or None,
                "base_model": r.base_model or None,
                "kind": r.kind,
                "quantity": r.quantity,
                "gigabyte_hours": r.gigabyte_hours,
            }
            for r in rows
        ]
    }
