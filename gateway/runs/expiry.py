"""Background expiry: silent sessions, checkpoints past their TTL, old access_denied events; how a
session ends.

`finish_sessions` ends sessions (the client's finish_session, and expiry): it gives back their
training-client slots and releases their adapters from the Trainer. The sweep also releases any
adapter a Trainer still holds for a finished session's run, so an adapter whose release failed
cannot outlive the quota slot it was charged to.

A session whose last heartbeat is older than ``session_timeout_seconds`` is marked finished with
reason ``expired`` and the adapters of its training runs are released from the Trainer (their saved
checkpoints stay). Its clients then get 410 naming what happened (`gateway.deps`). Checkpoints whose
``expires_at`` passed are deleted, files and row. Every gateway replica may run this; each step is
idempotent. Reads also check expiry themselves, so nothing expired is served between sweeps.
"""

from __future__ import annotations

import asyncio
import logging
from datetime import timedelta

from sqlalchemy import Engine
from sqlmodel import Session, col, select

from gateway.accounts.audit import prune_denied_events
from gateway.config import ServerConfig
from gateway.db.tables import CheckpointRow, SessionRow, TrainingRunRow, UserRow, utcnow
from gateway.engine_client import EngineClient
from gateway.runs.checkpoints import CHECKPOINT_DELETED, delete_checkpoint
from gateway.runs.retention import prune_rows
from gateway.runs.stability_records import drop_sessions

log = logging.getLogger(__name__)
EXPIRED = "expired"


def expired_session_message(session_id: str) -> str:
    return (
        f"session {session_id} expired: no heartbeat within the server's session timeout, so "
        "its adapters were "
        "released (checkpoints you saved are kept). Create a new ServiceClient; resume with "
        "create_training_client_from_state(<tinker:// path of a saved state>)"
    )


def purge_expired_checkpoints(db: Session) -> list[tuple[int, str]]:
    """Delete expired checkpoints (files and rows); their (user_id, tinker_path)."""
    now = utcnow()
    rows = db.exec(
        select(CheckpointRow).where(
            col(CheckpointRow.expires_at).is_not(None), col(CheckpointRow.expires_at) <= now
        )
    ).all()
    deleted = []
    for row in rows:
        deleted.append((row.user_id, row.tinker_path))
        delete_checkpoint(db, row)
    return deleted


async def release_adapters(engine: EngineClient, runs: list[tuple[str, str]]) -> None:
    """Drop the adapters of ``runs`` ((base model, run id)) from their Trainers. Idempotent: an
    adapter already gone (never created, released by another replica) is skipped."""
    for base, run_id in runs:
        if not engine.serves(base):
            continue
        try:
            await engine.trainer(base).delete_adapter(run_id)
        except Exception as exc:  # already gone, or its replica is down (the sweep retries)
            log.info("releasing adapter %s of a finished session: %s", run_id, exc)


async def finish_sessions(
    db: Session, engine: EngineClient, quotas, sessions: list[SessionRow], reason: str
) -> None:
    """Mark ``sessions`` finished with ``reason``, give back their training-client slots and
    release their adapters (their checkpoints stay). Every way a session ends comes here: the
    client finishing it, and the expiry of a silent one."""
    runs: list[tuple[str, str]] = []
    slots: list[tuple[int, int | None, list[str]]] = []
    for s in sessions:
        s.finished_at = utcnow()
        s.finish_reason = reason
        db.add(s)
        mine = list(db.exec(select(TrainingRunRow).where(TrainingRunRow.session_id == s.id)))
        runs += [(r.base_model, r.id) for r in mine]
        user = db.get(UserRow, s.user_id)
        slots.append((s.user_id, user.org_id if user else None, [r.id for r in mine]))
    drop_sessions(db, [s.id for s in sessions])
    db.commit()
    if quotas is not None:
        for user_id, org_id, run_ids in slots:
            await quotas.release_training_clients(user_id, org_id, run_ids)
    await release_adapters(engine, runs)


async def expire_sessions(
    db_engine: Engine, engine: EngineClient, timeout_s: float, quotas=None
) -> list[str]:
    """Expire silent sessions and release their adapters (and their training-client quota
    slots); the expired session ids."""
    cutoff = utcnow() - timedelta(seconds=timeout_s)
    with Session(db_engine) as db:
        stale = list(
            db.exec(
                select(SessionRow).where(
                    col(SessionRow.finished_at).is_(None), SessionRow.last_heartbeat_at < cutoff
                )
            )
        )
        ids = [s.id for s in stale]
        await finish_sessions(db, engine, quotas, stale, EXPIRED)
    if ids:
        log.info("expired %d silent session(s): %s", len(ids), ids)
    return ids


async def release_finished_adapters(db_engine: Engine, engine: EngineClient) -> list[str]:
    """Release every adapter a Trainer still holds for a run of a finished session (one whose
    release failed when it finished, e.g. its replica was restarting); the run ids released.
    Asks each Trainer replica which adapters it holds, so the work is bounded by the adapters
    loaded, not by the history of finished sessions."""
    released: list[str] = []
    for base in engine.base_models:
        held = {
            a["model_id"] for st in await engine.every_trainer(base).stats() for a in st["adapters"]
        }
        if not held:
            continue
        with Session(db_engine) as db:
            rows = db.exec(
                select(TrainingRunRow.id)
                .join(SessionRow, col(SessionRow.id) == TrainingRunRow.session_id)
                .where(col(TrainingRunRow.id).in_(held), col(SessionRow.finished_at).is_not(None))
            ).all()
        await release_adapters(engine, [(base, r) for r in rows])
        released += rows
    return released


async def sweep_forever(
    db_engine: Engine,
    engine: EngineClient,
    config: ServerConfig,
    quotas=None,
    checkpoint_deleted=None,
) -> None:
    while True:
        await asyncio.sleep(config.session_sweep_seconds)
        try:
            await expire_sessions(db_engine, engine, config.session_timeout_seconds, quotas)
            await release_finished_adapters(db_engine, engine)
            prune_rows(db_engine, config.gateway)
            with Session(db_engine) as db:
                if checkpoint_deleted is not None:
                    db.info[CHECKPOINT_DELETED] = checkpoint_deleted
                purge_expired_checkpoints(db)
                gw = config.gateway
                prune_denied_events(
                    db,
                    max_age_s=gw.audit_denied_retention_days * 86400,
                    max_rows=gw.audit_denied_max_rows,
                )
        except Exception:  # keep sweeping; one bad pass must not stop expiry for good
            log.exception("expiry sweep failed")
