"""Sessions: opening one, and the per-user and per-session bounds on the rows they make.

Owns `open_session` (every dialect's create_session: a Tinker ServiceClient, a native
twinkle_client session) and `check_sampling_room` (Tinker's create_sampling_session). A session row
and each sampling-session row is stored until the session ends, so a tenant looping on
create_session would grow the database without bound; live sessions are capped per user
(``gateway.max_live_sessions_per_user``) and sampling sessions per session
(``gateway.max_sampling_sessions_per_session``), each a 403 naming the setting. A session stops
counting when it finishes or expires (no heartbeat for ``session_timeout_seconds``).
"""

from __future__ import annotations

import uuid
from typing import Any

from sqlmodel import Session, col, func, select

from gateway.accounts.keys import Principal
from gateway.config import ServerConfig
from gateway.db.tables import SamplingSessionRow, SessionRow
from gateway.errors import QuotaExceededError


def open_session(db: Session, who: Principal, config: ServerConfig, **fields: Any) -> SessionRow:
    """A new live session of ``who`` (committed), under ``gateway.max_live_sessions_per_user``."""
    cap = config.gateway.max_live_sessions_per_user
    live = db.exec(
        select(func.count())
        .select_from(SessionRow)
        .where(SessionRow.user_id == who.user_id, col(SessionRow.finished_at).is_(None))
    ).one()
    if live >= cap:
        raise QuotaExceededError(
            f"sessions: you have {live} sessions that have not ended, the server keeps at most "
            f"{cap} (gateway.max_live_sessions_per_user); close clients you no longer use "
            "(ServiceClient.close), or wait for idle sessions to expire",
            "max_live_sessions_per_user",
            cap,
            live,
        )
    row = SessionRow(id=f"sess-{uuid.uuid4().hex[:16]}", user_id=who.user_id, **fields)
    db.add(row)
    db.commit()
    return row


def check_sampling_room(db: Session, session: SessionRow, config: ServerConfig) -> None:
    """403 when ``session`` already has ``gateway.max_sampling_sessions_per_session``."""
    cap = config.gateway.max_sampling_sessions_per_session
    n = db.exec(
        select(func.count())
        .select_from(SamplingSessionRow)
        .where(SamplingSessionRow.session_id == session.id)
    ).one()
    if n >= cap:
        raise QuotaExceededError(
            f"sampling sessions: session {session.id} has {n}, the server keeps at most {cap} "
            "per session (gateway.max_sampling_sessions_per_session); reuse a sampling client, "
            "or open a new ServiceClient",
            "max_sampling_sessions_per_session",
            cap,
            n,
        )
