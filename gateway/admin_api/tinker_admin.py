"""What the Tinker SDK's ``AdminClient`` calls, answered for the caller's organization (admin
scope): ``GET /api/v1/audit``, ``GET /api/v1/billing/usage/events`` and
``GET /api/v1/billing/usage/checkpoints/current``."""

from __future__ import annotations

from datetime import UTC, date, datetime, timedelta

from fastapi import APIRouter, Query
from sqlmodel import col, func, select

from gateway.accounts.audit import event_json, list_events
from gateway.accounts.keys import AdminPrincipalDep
from gateway.accounts.usage import GB, billing_event, query
from gateway.db.tables import CheckpointRow, UserRow
from gateway.deps import DbDep
from gateway.errors import InvalidRequestError

router = APIRouter(prefix="/api/v1")

#: audit event families the SDK filters on, mapped to our event names' resource part
_FAMILIES = {
    "checkpoints": ("checkpoint_",),
    "projects": ("project_",),
    "teams": ("user_", "key_", "quota_", "access_"),
    "organizations": ("organization_", "user_", "key_", "quota_", "access_"),
}


def naive_utc(ts: datetime) -> datetime:
    return ts.astimezone(UTC).replace(tzinfo=None) if ts.tzinfo else ts


@router.get("/audit")
async def audit_log(
    who: AdminPrincipalDep, db: DbDep, event_type: str = "all", day: date | None = None
) -> dict:
    if event_type != "all" and event_type not in _FAMILIES:
        raise InvalidRequestError(
            f"event_type: must be 'all' or one of {sorted(_FAMILIES)}, got {event_type!r}"
        )
    day = day or datetime.now(UTC).date()
    start = datetime(day.year, day.month, day.day)
    rows = list_events(db, org_id=who.org_id, start=start, end=start + timedelta(days=1))
    if event_type != "all":
        rows = [r for r in rows if r.event.startswith(_FAMILIES[event_type])]
    return {"entries": [event_json(r) for r in rows]}


@router.get("/billing/usage/events")
async def billing_usage(
    who: AdminPrincipalDep,
    db: DbDep,
    starting_on: datetime = Query(),
    ending_before: datetime = Query(),
) -> dict:
    start, end = naive_utc(starting_on), naive_utc(ending_before)
    if end <= start:
        raise InvalidRequestError("ending_before: must be after starting_on")
    if end - start > timedelta(days=14):
        raise InvalidRequestError("ending_before: at most 14 days after starting_on")
    rows = query(db, org_id=who.org_id, start=start, end=end)
    names = dict(db.exec(select(UserRow.id, UserRow.name)).all())
    return {"data": [billing_event(r, names.get(r.user_id)) for r in rows], "sessions": {}}


@router.get("/billing/usage/checkpoints/current")
async def checkpoint_storage(
    who: AdminPrincipalDep, db: DbDep, project_id: str | None = None
) -> dict:
    q = (
        select(UserRow.id, UserRow.name, func.count(), func.sum(CheckpointRow.size_bytes))
        .join(UserRow, col(UserRow.id) == CheckpointRow.user_id)
        .where(CheckpointRow.ephemeral == False)  # noqa: E712
        .group_by(col(UserRow.id), col(UserRow.name))
        .order_by(col(UserRow.id))
    )
    if who.org_id is not None:
        q = q.where(UserRow.org_id == who.org_id)
    data = [
        {
            "project_id": project_id,
            "org_user_urn": f"tml:user:{uid}",
            "user_name": name,
            "checkpoint_count": int(count),
            "size_bytes": int(size or 0),
            "size_gigabytes": float(size or 0) / GB,
        }
        for uid, name, count, size in db.exec(q).all()
    ]
    return {"data": data}
