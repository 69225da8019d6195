"""Stability records: what a sampler recorded for each sequence a sampling client with
``record_stability_info`` returned (per sequence its prompt, sampled tokens and the sampler's own
logprob of each, computed by the server), in `StabilityRecordRow`, the DB every gateway replica
shares. Read by ``stable_reinforce`` training requests through their provenance spans
(gateway/tinker_api/provenance.py).

Owns: `new_sequence_ids` (every sample future's ``sample_sequence_ids``), `record`, and the
records' lifetime. A record belongs to its client session. It is usable for
``gateway.stability_ttl_seconds`` (one day), restarted by each training request that names it
(`touch`); at most ``gateway.max_stability_records_per_session`` per session, the oldest evicted
when a new one passes the cap (sampling is never refused for it); all of a session's go when it
finishes or expires (`drop_sessions`, gateway/runs/expiry.py), expired ones by the sweep
(`prune_expired`, gateway/runs/retention.py).
"""

from __future__ import annotations

import uuid
from datetime import timedelta

import numpy as np
from sqlalchemy import Engine, delete, func, update
from sqlmodel import Session, col, select

from engine.protocol import SampleOutput
from gateway.db.tables import StabilityRecordRow, utcnow


def new_sequence_ids(n: int) -> list[str]:
    """``n`` fresh sequence ids (one per sample of a request): unguessable, so one session
    cannot name another's records by counting."""
    stem = uuid.uuid4().hex
    return [f"{stem}:{i}" for i in range(n)]


def record(
    bind: Engine,
    session_id: str,
    ids: list[str],
    prompt: list[int],
    out: SampleOutput,
    ttl_s: float,
    cap: int,
) -> None:
    """Store the sequences of ``out`` under ``ids``; evict the session's oldest past ``cap``."""
    now = utcnow()
    prompt_b = np.asarray(prompt, dtype=np.int32).tobytes()
    rows = [
        StabilityRecordRow(
            sequence_id=sid,
            session_id=session_id,
            prompt=prompt_b,
            tokens=np.asarray(seq.tokens, dtype=np.int32).tobytes(),
            logprobs=np.asarray(seq.logprobs, dtype=np.float32).tobytes(),
            created_at=now,
            expires_at=now + timedelta(seconds=ttl_s),
        )
        for sid, seq in zip(ids, out.sequences, strict=True)
    ]
    with Session(bind) as db:
        db.add_all(rows)
        db.commit()
        mine = col(StabilityRecordRow.session_id) == session_id
        count = db.exec(select(func.count()).select_from(StabilityRecordRow).where(mine)).one()
        if count > cap:
            # the id of the newest record not kept; it and every older one go
            edge = db.exec(
                select(StabilityRecordRow.id)
                .where(mine)
                .order_by(col(StabilityRecordRow.id).desc())
                .offset(cap)
            ).first()
            db.connection().execute(
                delete(StabilityRecordRow).where(mine, col(StabilityRecordRow.id) <= edge)
            )
            db.commit()


def drop_sessions(db: Session, session_ids: list[str]) -> None:
    """Delete every record of ``session_ids`` (they ended); the caller commits."""
    if session_ids:
        stmt = delete(StabilityRecordRow).where(col(StabilityRecordRow.session_id).in_(session_ids))
        db.connection().execute(stmt)


def prune_expired(db: Session) -> None:
    """Delete expired records."""
    stmt = delete(StabilityRecordRow).where(col(StabilityRecordRow.expires_at) < utcnow())
    db.connection().execute(stmt)
    db.commit()


def load(db: Session, session_id: str, ids: set[str]) -> dict[str, StabilityRecordRow]:
    """The records of ``ids`` that belong to ``session_id`` (expired ones included)."""
    rows = db.exec(
        select(StabilityRecordRow).where(
            col(StabilityRecordRow.sequence_id).in_(sorted(ids)),
            StabilityRecordRow.session_id == session_id,
        )
    ).all()
    return {r.sequence_id: r for r in rows}


def touch(db: Session, ids: set[str], ttl_s: float) -> None:
    """Restart the period of ``ids``: a training request used them."""
    db.connection().execute(
        update(StabilityRecordRow)
        .where(col(StabilityRecordRow.sequence_id).in_(sorted(ids)))
        .values(expires_at=utcnow() + timedelta(seconds=ttl_s))
    )
    db.commit()
