"""Retention of the rows tenants make as they work: the sweep's pruning of stored custom losses
and request traces, so neither grows without bound.

* Custom losses (`CustomLossRow`) are usable only by the training clients of the session that
  uploaded them, so once the session has ended (finished or expired; its models then answer 410)
  they are deleted. Live ones are capped per user at upload (`gateway.max_custom_losses`, in
  gateway/tinker_api/custom_losses.py).
* Request traces (`RequestTraceRow`, one per finished request of a session) are kept
  ``gateway.trace_retention_seconds`` and at most ``gateway.max_trace_rows_per_user`` per user,
  the newest kept: a tenant stepping 10 times a second for a week would otherwise leave six
  million rows.
* Stability records (`StabilityRecordRow`) past their expiry are deleted (an ended session's go
  when it ends, gateway/runs/expiry.py).

Every gateway replica may run this; each step is idempotent.
"""

from __future__ import annotations

import time

from sqlalchemy import Delete, Engine, delete, func
from sqlmodel import Session, col, select

from gateway.config import GatewayConfig
from gateway.db.tables import CustomLossRow, RequestTraceRow, SessionRow
from gateway.runs.stability_records import prune_expired


def _delete(db: Session, stmt: Delete) -> int:
    return int(getattr(db.connection().execute(stmt), "rowcount", 0) or 0)


def prune_custom_losses(db: Session) -> int:
    """Delete the custom losses of ended sessions; how many."""
    ended = select(SessionRow.id).where(col(SessionRow.finished_at).is_not(None))
    gone = _delete(db, delete(CustomLossRow).where(col(CustomLossRow.session_id).in_(ended)))
    db.commit()
    return gone


def prune_request_traces(db: Session, retention_s: float, per_user: int) -> int:
    """Delete trace rows older than ``retention_s`` and each user's beyond their ``per_user``
    newest; how many."""
    cutoff = time.time() - retention_s
    gone = _delete(db, delete(RequestTraceRow).where(col(RequestTraceRow.finished) < cutoff))
    over = db.exec(
        select(RequestTraceRow.user_id)
        .group_by(col(RequestTraceRow.user_id))
        .having(func.count() > per_user)
    ).all()
    for user_id in over:
        # the id of the user's newest row not kept; it and every older one go
        edge = db.exec(
            select(RequestTraceRow.id)
            .where(RequestTraceRow.user_id == user_id)
            .order_by(col(RequestTraceRow.id).desc())
            .offset(per_user)
        ).first()
        stmt = delete(RequestTraceRow).where(
            col(RequestTraceRow.user_id) == user_id, col(RequestTraceRow.id) <= edge
        )
        gone += _delete(db, stmt)
    db.commit()
    return gone


def prune_rows(db_engine: Engine, config: GatewayConfig) -> None:
    with Session(db_engine) as db:
        prune_custom_losses(db)
        prune_request_traces(db, config.trace_retention_seconds, config.max_trace_rows_per_user)
        prune_expired(db)
