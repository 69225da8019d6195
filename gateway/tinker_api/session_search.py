"""Session search (RestClient.search_sessions, experimental in the SDK): ``POST /sessions/search``.

The request is the SDK's ``SessionSearchRequest``; the answer its ``SessionSearchResponse`` (one
page, newest first, ``next_cursor`` until the results run out). Semantics, as the SDK documents
them: ``session_id`` exact, ``display_name`` a case-insensitive match of every word (with both,
either one matches), ``user_metadata`` exact pairs (all must hold), ``project_ids`` any of,
``statuses`` any of. Beyond the SDK's fields (it cannot send them; other clients can):
``created_after`` / ``created_before`` (ISO times), ``base_model`` (a training run or sampler of the
session uses it) and ``metadata_text`` (a case-insensitive substring of any user_metadata value).

Who is searched: ``owner.type`` ``own`` (default) the caller; ``accessible`` every user for an admin
key, the caller otherwise (nobody else's sessions are listable by a user); ``user`` the listed
``tml:user:<id>`` URNs, where a user key may name only itself (another user → 403). Statuses:
``active`` (not finished), ``client_finished`` (the client called finish; ``reasons`` filter
success / errored / interrupted); an expired session (no heartbeat) has no status, and this server
never fails or cancels a whole session, so ``failed`` / ``cancelled`` match nothing.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any, Literal

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict, Field
from sqlalchemy import and_, func, or_
from sqlmodel import Session, col, select

from gateway.accounts.keys import Principal
from gateway.db.tables import CheckpointRow, SamplingSessionRow, SessionRow, TrainingRunRow
from gateway.deps import DbDep, PrincipalDep
from gateway.errors import InvalidRequestError, PermissionDeniedError
from gateway.runs.expiry import EXPIRED
from gateway.tinker_api.schemas import WireRequest

router = APIRouter(prefix="/api/v1")
#: sessions read per round while filtering in Python (metadata, names, statuses)
_BATCH = 500
#: at most this many sessions are examined per page: a search that matches almost nothing in a
#: huge history answers a shorter page with a cursor instead of scanning for ever
_SCAN_LIMIT = 20_000
_URN = "tml:user:"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class OwnerQuery(_Strict):
    type: Literal["own", "accessible", "user"] = "own"
    owner_urns: list[str] | None = Field(default=None, min_length=1, max_length=10)


class StatusQuery(_Strict):
    type: Literal["active", "cancelled", "failed", "client_finished"]
    reasons: list[Literal["success", "errored", "interrupted"]] | None = Field(
        default=None, min_length=1
    )


class SearchCursor(_Strict):
    last_created_at: datetime
    last_session_id: str = Field(max_length=64)


class SessionSearchRequest(WireRequest):
    session_id: str | None = Field(default=None, max_length=64)
    project_ids: list[str] | None = Field(default=None, max_length=100)
    user_metadata: dict[str, str] = Field(default_factory=dict, max_length=32)
    display_name: str | None = Field(default=None, min_length=1, max_length=256)
    owner: OwnerQuery = Field(default_factory=OwnerQuery)
    statuses: list[StatusQuery] | None = Field(default=None, min_length=1)
    limit: int = Field(default=50, ge=1, le=200)
    cursor: SearchCursor | None = None
    created_after: datetime | None = None
    created_before: datetime | None = None
    base_model: str | None = Field(default=None, min_length=1, max_length=256)
    metadata_text: str | None = Field(default=None, min_length=1, max_length=256)


def _naive(t: datetime) -> datetime:
    """Naive UTC (the DB's convention) of an aware or naive time."""
    return t if t.tzinfo is None else t.astimezone(UTC).replace(tzinfo=None)


def _owners(req: SessionSearchRequest, who: Principal) -> list[int] | None:
    """The user ids searched; None = everyone (admins only)."""
    if req.owner.type == "own":
        return [who.user_id]
    if req.owner.type == "accessible":
        return None if who.is_admin else [who.user_id]
    ids = []
    for urn in req.owner.owner_urns or []:
        raw = urn[len(_URN) :] if urn.startswith(_URN) else ""
        if not raw.isdigit():
            raise InvalidRequestError(f"owner.owner_urns: {urn!r} is not a tml:user:<id> URN")
        ids.append(int(raw))
    if not ids:
        raise InvalidRequestError("owner.owner_urns: required with owner.type 'user'")
    if not who.is_admin and any(i != who.user_id for i in ids):
        raise PermissionDeniedError("owner.owner_urns: a user key may search only its own sessions")
    return ids


def status_of(row: SessionRow) -> dict[str, Any] | None:
    """The SDK's ``SessionStatus`` of a session (None: expired, neither running nor finished)."""
    if row.finished_at is None:
        return {"type": "active"}
    if row.finish_reason == EXPIRED:
        return None
    return {"type": "client_finished", "reason": {"type": row.finish_reason or "success"}}


def _status_ok(row: SessionRow, wanted: list[StatusQuery] | None) -> bool:
    if wanted is None:
        return True
    status = status_of(row)
    for q in wanted:
        if status is None or q.type != status["type"]:
            continue
        if q.type != "client_finished" or q.reasons is None:
            return True
        if status["reason"]["type"] in q.reasons:
            return True
    return False


def _matches(row: SessionRow, req: SessionSearchRequest) -> bool:
    meta = {str(k): str(v) for k, v in (row.user_metadata or {}).items()}
    if any(meta.get(k) != v for k, v in req.user_metadata.items()):
        return False
    if req.metadata_text and not any(req.metadata_text.lower() in v.lower() for v in meta.values()):
        return False
    by_id = req.session_id is not None and row.id == req.session_id
    if req.display_name is not None:
        name = (row.display_name or "").lower()
        by_name = all(w in name for w in req.display_name.lower().split())
        if not (by_id or by_name):
            return False
    elif req.session_id is not None and not by_id:
        return False
    return _status_ok(row, req.statuses)


def _query(req: SessionSearchRequest, owners: list[int] | None):
    q = select(SessionRow)
    if owners is not None:
        q = q.where(col(SessionRow.user_id).in_(owners))
    if req.project_ids is not None:
        q = q.where(col(SessionRow.project_id).in_(req.project_ids))
    if req.created_after is not None:
        q = q.where(SessionRow.created_at >= _naive(req.created_after))
    if req.created_before is not None:
        q = q.where(SessionRow.created_at < _naive(req.created_before))
    if req.base_model is not None:
        runs = select(TrainingRunRow.session_id).where(TrainingRunRow.base_model == req.base_model)
        samplers = select(SamplingSessionRow.session_id).where(
            SamplingSessionRow.base_model == req.base_model
        )
        q = q.where(or_(col(SessionRow.id).in_(runs), col(SessionRow.id).in_(samplers)))
    if req.cursor is not None:
        at, sid = _naive(req.cursor.last_created_at), req.cursor.last_session_id
        q = q.where(
            or_(
                col(SessionRow.created_at) < at,
                and_(col(SessionRow.created_at) == at, col(SessionRow.id) < sid),
            )
        )
    return q.order_by(col(SessionRow.created_at).desc(), col(SessionRow.id).desc())


def _summary(db: Session, row: SessionRow) -> dict[str, Any]:
    runs = select(TrainingRunRow.id).where(TrainingRunRow.session_id == row.id)
    count, size = db.exec(
        select(func.count(), func.coalesce(func.sum(CheckpointRow.size_bytes), 0)).where(
            col(CheckpointRow.run_id).in_(runs)
        )
    ).one()
    meta = {str(k): str(v) for k, v in (row.user_metadata or {}).items()}
    return {
        "session_id": row.id,
        "created_at": row.created_at.isoformat() + "Z",
        "owner": f"{_URN}{row.user_id}",
        "project_id": row.project_id or "",
        "status": status_of(row),
        "checkpoints_count": int(count),
        "display_name": row.display_name,
        "user_metadata": meta or None,
        "checkpoint_storage_bytes": int(size),
    }


def _scan(db: Session, req: SessionSearchRequest, owners: list[int] | None):
    """(matching rows, up to ``limit``; the row the next page starts after; whether a next page
    can hold anything): it looks one match ahead, so the last page has no cursor."""
    query = _query(req, owners)
    found: list[SessionRow] = []
    last: SessionRow | None = None
    offset = 0
    while offset < _SCAN_LIMIT:
        batch = db.exec(query.offset(offset).limit(_BATCH)).all()
        for row in batch:
            last = row
            if _matches(row, req):
                if len(found) == req.limit:  # a match beyond this page
                    return found, found[-1], True
                found.append(row)
        offset += len(batch)
        if len(batch) < _BATCH:
            return found, last, False
    return found, last, True  # scan budget spent: the next page goes on after the last row read


@router.post("/sessions/search")
async def search_sessions(req: SessionSearchRequest, who: PrincipalDep, db: DbDep) -> dict:
    """One page of matching sessions, newest first (see the module docstring)."""
    found, last, more = _scan(db, req, _owners(req, who))
    cursor = None
    if more and last is not None:
        cursor = {"last_created_at": last.created_at.isoformat() + "Z", "last_session_id": last.id}
    return {"sessions": [_summary(db, r) for r in found], "next_cursor": cursor}
