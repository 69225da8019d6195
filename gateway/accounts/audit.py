"""The audit log of admin and security events.

Owns writing events (``<resource>_<action>``: key_created, key_revoked, organization_created,
user_created, user_updated, organization_updated, quota_changed, access_denied) and reading them
back as the Tinker SDK's ``AuditLogResponse`` entries. Events carry a key's display prefix at
most, never the key. Denied requests are written in their own short transaction, so a failing
request still leaves its trace; the write is best effort (a DB hiccup never turns a 401 into a
500). What an unauthenticated caller can make the DB hold is bounded three ways: each
``access_denied`` row stores the matched route template and at most `DENIED_PATH_CHARS` of the raw
path (not the whole URL, which may be ~64 KiB), rows are throttled per process
(`DENIED_PER_MINUTE`), and `prune_denied_events` (run by the expiry sweep) drops them past their
retention age and beyond a row cap (``gateway.audit_denied_*``).
"""

from __future__ import annotations

import logging
import threading
import time
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

from fastapi import Request
from sqlalchemy import delete, func
from sqlmodel import Session, col, select

from gateway.db.tables import AuditEventRow, utcnow

if TYPE_CHECKING:  # gateway.context imports this module: the type only
    from gateway.context import AppServices

log = logging.getLogger(__name__)


def record_event(
    session: Session,
    event: str,
    *,
    org_id: int | None = None,
    actor_user_id: int | None = None,
    actor_key_prefix: str | None = None,
    details: dict[str, Any] | None = None,
) -> AuditEventRow:
    """Add an event to ``session`` (the caller commits with its own change)."""
    row = AuditEventRow(
        event=event,
        org_id=org_id,
        actor_user_id=actor_user_id,
        actor_key_prefix=actor_key_prefix,
        details=details or {},
    )
    session.add(row)
    return row


#: at most this many access_denied rows per minute per gateway process, so a flood of bad keys
#: cannot fill the database (the excess is counted in a log line instead)
DENIED_PER_MINUTE = 120
#: an access_denied row keeps this much of the raw path (every route's own path is shorter), the
#: method and the reason as much: a row stays under ~1 KiB whatever the request carried
DENIED_PATH_CHARS = 256
DENIED_METHOD_CHARS = 16
DENIED_REASON_CHARS = 256
ACCESS_DENIED = "access_denied"
_denied_window = {"minute": 0, "count": 0}
_denied_lock = threading.Lock()


def _denied_allowed() -> bool:
    minute = int(time.time() // 60)
    with _denied_lock:
        if _denied_window["minute"] != minute:
            if _denied_window["count"] > DENIED_PER_MINUTE:
                log.warning(
                    "%d access_denied events not audited in the last minute",
                    _denied_window["count"] - DENIED_PER_MINUTE,
                )
            _denied_window.update(minute=minute, count=0)
        _denied_window["count"] += 1
        return _denied_window["count"] <= DENIED_PER_MINUTE


def denied_details(request: Request, reason: str) -> dict[str, str]:
    """What an ``access_denied`` row says about the request, each value cut to its bound: the
    method, the raw path's start, the route template it matched (if any) and the reason."""
    details = {
        "method": request.method[:DENIED_METHOD_CHARS],
        "path": request.url.path[:DENIED_PATH_CHARS],
        "reason": reason[:DENIED_REASON_CHARS],
    }
    route = getattr(request.scope.get("route"), "path", None)
    if isinstance(route, str):
        details["route"] = route[:DENIED_PATH_CHARS]
    return details


def record_denied(request: Request, principal: Any, reason: str) -> None:
    """An ``access_denied`` event for this request (`denied_details`, who if known)."""
    services: AppServices | None = getattr(request.app.state, "services", None)
    if services is None or not _denied_allowed():  # an app outside its lifespan: no DB yet
        return
    details = denied_details(request, reason)
    try:
        with Session(services.db_engine) as session:
            record_event(
                session,
                ACCESS_DENIED,
                org_id=getattr(principal, "org_id", None),
                actor_user_id=getattr(principal, "user_id", None),
                actor_key_prefix=getattr(principal, "key_prefix", None) or None,
                details=details,
            )
            session.commit()
    except Exception:  # auditing must never change the answer
        log.warning("could not write access_denied audit event", exc_info=True)


def _rowcount(result: Any) -> int:
    """Rows a DELETE removed (a CursorResult's, which the generic Result type hides)."""
    return int(result.rowcount or 0)


def prune_denied_events(session: Session, *, max_age_s: float, max_rows: int) -> int:
    """Delete ``access_denied`` events older than ``max_age_s`` and all but the newest
    ``max_rows`` (>= 1) of them (admin events are kept); how many were deleted. Idempotent, so every
    replica's sweep may run it."""
    denied = col(AuditEventRow.event) == ACCESS_DENIED
    cutoff = utcnow() - timedelta(seconds=max_age_s)
    deleted = _rowcount(
        session.execute(delete(AuditEventRow).where(denied, col(AuditEventRow.created_at) < cutoff))
    )
    # the id of the oldest row to keep: rows are appended, so ids follow time
    keep_from = session.exec(
        select(AuditEventRow.id)
        .where(denied)
        .order_by(col(AuditEventRow.id).desc())
        .offset(max_rows - 1)
        .limit(1)
    ).first()
    if keep_from is not None:
        deleted += _rowcount(
            session.execute(delete(AuditEventRow).where(denied, col(AuditEventRow.id) < keep_from))
        )
    session.commit()
    if deleted:
        log.info("pruned %d access_denied audit events", deleted)
    return deleted


def list_events(
    session: Session,
    *,
    org_id: int | None,
    start: datetime | None = None,
    end: datetime | None = None,
    events: list[str] | None = None,
    limit: int = 1000,
    offset: int = 0,
    newest_first: bool = False,
) -> list[AuditEventRow]:
    """Events in [start, end), oldest first (or newest first), skipping ``offset`` of them;
    ``org_id`` None means every organization."""
    q = _filtered(select(AuditEventRow), org_id, start, end, events)
    order = [col(AuditEventRow.created_at), col(AuditEventRow.id)]
    if newest_first:
        order = [o.desc() for o in order]
    return list(session.exec(q.order_by(*order).offset(offset).limit(limit)))


def count_events(
    session: Session,
    *,
    org_id: int | None,
    start: datetime | None = None,
    end: datetime | None = None,
    events: list[str] | None = None,
) -> int:
    """How many events `list_events` pages through with the same filters."""
    q = _filtered(select(func.count()).select_from(AuditEventRow), org_id, start, end, events)
    return int(session.exec(q).one())


def _filtered(q, org_id, start, end, events):
    if org_id is not None:
        q = q.where(AuditEventRow.org_id == org_id)
    if start is not None:
        q = q.where(AuditEventRow.created_at >= start)
    if end is not None:
        q = q.where(AuditEventRow.created_at < end)
    if events:
        q = q.where(col(AuditEventRow.event).in_(events))
    return q


def event_json(row: AuditEventRow) -> dict[str, Any]:
    """An entry shaped like the SDK's ``AuditLogEntry``."""
    details = dict(row.details or {})
    if row.actor_user_id is not None:
        details.setdefault("actor_user_id", row.actor_user_id)
    if row.actor_key_prefix:
        details.setdefault("actor_key_prefix", row.actor_key_prefix)
    if row.org_id is not None:
        details.setdefault("org_id", row.org_id)
    return {
        "timestamp": row.created_at.isoformat() + "Z",
        "event": row.event,
        "event_details": details,
    }
