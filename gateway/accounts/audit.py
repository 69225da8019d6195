"""The audit log of admin and security events.

Owns writing events (``<resource>_<action>``: key_created, key_revoked, organization_created,
user_created, user_updated, organization_updated, quota_changed, access_denied) and reading them
back as the Tinker SDK's ``AuditLogResponse`` entries. Events carry a key's display prefix at
most, never the key. Denied requests are written in their own short transaction, so a failing
request still leaves its trace; the write is best effort (a DB hiccup never turns a 401 into a
500) and throttled per process (`DENIED_PER_MINUTE`), so bad-key floods cannot fill the DB.
"""

from __future__ import annotations

import logging
import threading
import time
from datetime import datetime
from typing import TYPE_CHECKING, Any

from fastapi import Request
from sqlalchemy import func
from sqlmodel import Session, col, select

from gateway.db.tables import AuditEventRow

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


def record_denied(request: Request, principal: Any, reason: str) -> None:
    """An ``access_denied`` event for this request (method, path, reason, who if known)."""
    services: AppServices | None = getattr(request.app.state, "services", None)
    if services is None or not _denied_allowed():  # an app outside its lifespan: no DB yet
        return
    details = {"method": request.method, "path": request.url.path, "reason": reason}
    try:
        with Session(services.db_engine) as session:
            record_event(
                session,
                "access_denied",
                org_id=getattr(principal, "org_id", None),
                actor_user_id=getattr(principal, "user_id", None),
                actor_key_prefix=getattr(principal, "key_prefix", None) or None,
                details=details,
            )
            session.commit()
    except Exception:  # auditing must never change the answer
        log.warning("could not write access_denied audit event", exc_info=True)


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
