"""Tinker REST endpoints over training runs and their checkpoints (RestClient): list / get runs
(``access_scope`` owned = yours, accessible = yours plus runs with a published checkpoint), list a
run's checkpoints and all of yours, delete one. Expired checkpoints are purged before any listing,
so they never show."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Literal

from fastapi import APIRouter, Query
from sqlmodel import col, func, select

from gateway.db.tables import CheckpointRow, TrainingRunRow, UserRow
from gateway.deps import DB_INT_MAX, DbDep, PrincipalDep, owned_run
from gateway.errors import NotFoundError
from gateway.quotas import QuotasDep
from gateway.runs.checkpoints import SEGMENT_OF_KIND, delete_checkpoint, parse_path
from gateway.runs.expiry import purge_expired_checkpoints
from gateway.tinker_api.schemas import (
    CheckpointsListResponse,
    DeleteCheckpointResponse,
    TrainingRun,
    TrainingRunsResponse,
    returns,
)

Scope = Literal["owned", "accessible"]

router = APIRouter(prefix="/api/v1")


def iso(ts: datetime | None) -> str | None:
    return None if ts is None else ts.isoformat() + "Z"


def checkpoint_json(row: CheckpointRow) -> dict:
    return {
        "checkpoint_id": f"{SEGMENT_OF_KIND[row.kind]}/{row.name}",
        "checkpoint_type": row.kind,
        "time": iso(row.created_at),
        "tinker_path": row.tinker_path,
        "size_bytes": row.size_bytes,
        "public": row.public,
        "user_metadata": row.user_metadata or None,
        "expires_at": iso(row.expires_at),
    }


def _visible(user_id: int):
    """Checkpoints a user may see: their own, and anyone's published ones (never ephemeral)."""
    return (col(CheckpointRow.ephemeral) == False) & (  # noqa: E712
        (col(CheckpointRow.user_id) == user_id) | (col(CheckpointRow.public) == True)  # noqa: E712
    )


def _runs_where(user_id: int, access_scope: str):
    owned = col(TrainingRunRow.user_id) == user_id
    if access_scope == "owned":
        return owned
    public_runs = select(CheckpointRow.run_id).where(
        CheckpointRow.public == True,  # noqa: E712  # SQL, not a truth test
        CheckpointRow.ephemeral == False,  # noqa: E712
    )
    return owned | col(TrainingRunRow.id).in_(public_runs)


def run_json(
    db, run: TrainingRunRow, owner_name: str | None = None, viewer: int | None = None
) -> dict:
    if owner_name is None:
        owner = db.get(UserRow, run.user_id)
        owner_name = owner.name if owner else str(run.user_id)
    viewer = run.user_id if viewer is None else viewer

    def last(kind: str) -> dict | None:
        row = db.exec(
            select(CheckpointRow)
            .where(CheckpointRow.run_id == run.id, CheckpointRow.kind == kind, _visible(viewer))
            .order_by(col(CheckpointRow.created_at).desc())
        ).first()
        return checkpoint_json(row) if row else None

    return {
        "training_run_id": run.id,
        "base_model": run.base_model,
        "model_owner": owner_name,
        "is_lora": True,
        "corrupted": False,
        "lora_rank": run.lora_rank,
        "last_request_time": iso(run.last_request_time),
        "last_checkpoint": last("training"),
        "last_sampler_checkpoint": last("sampler"),
        "user_metadata": run.user_metadata or None,
    }


@router.get("/training_runs", **returns(TrainingRunsResponse))
async def list_training_runs(
    who: PrincipalDep,
    db: DbDep,
    limit: int = Query(20, ge=1, le=1000),
    offset: int = Query(0, ge=0, le=DB_INT_MAX),
    access_scope: Scope = "owned",
    project_id: str | None = None,
) -> dict:
    """Your training runs (or, scope accessible, also runs with a published checkpoint)."""
    purge_expired_checkpoints(db)
    where = _runs_where(who.user_id, access_scope)
    if project_id is not None:
        from gateway.db.tables import SessionRow

        where = where & col(TrainingRunRow.session_id).in_(
            select(SessionRow.id).where(SessionRow.project_id == project_id)
        )
    total = db.exec(select(func.count()).select_from(TrainingRunRow).where(where)).one()
    rows = db.exec(
        select(TrainingRunRow)
        .where(where)
        .order_by(col(TrainingRunRow.created_at).desc())
        .offset(offset)
        .limit(limit)
    ).all()
    return {
        "training_runs": [run_json(db, r, viewer=who.user_id) for r in rows],
        "cursor": {"offset": offset, "limit": limit, "total_count": total},
    }


def visible_run(db, who, run_id: str, access_scope: str = "accessible") -> TrainingRunRow:
    """The run if the caller owns it, or (scope accessible) it has a published checkpoint."""
    if run_id.startswith(("tinker://", "twinkle://")):
        run_id = parse_path(run_id, "training_run_id").run_id
    run = db.exec(
        select(TrainingRunRow).where(
            TrainingRunRow.id == run_id, _runs_where(who.user_id, access_scope)
        )
    ).first()
    if run is None:
        raise NotFoundError(f"training_run_id: training run {run_id!r} not found")
    return run


@router.get("/training_runs/{run_id}/checkpoints", **returns(CheckpointsListResponse))
async def list_run_checkpoints(
    run_id: str,
    who: PrincipalDep,
    db: DbDep,
    limit: Annotated[int, Query(ge=1, le=10000)] = 1000,  # plain defaults: the native API
    offset: Annotated[
        int, Query(ge=0, le=DB_INT_MAX)
    ] = 0,  # (gateway/twinkle_api) calls this directly
) -> dict:
    """The checkpoints of a training run you can see, oldest first."""
    purge_expired_checkpoints(db)
    visible_run(db, who, run_id)
    where = (col(CheckpointRow.run_id) == run_id) & _visible(who.user_id)
    total = db.exec(select(func.count()).select_from(CheckpointRow).where(where)).one()
    rows = db.exec(
        select(CheckpointRow)
        .where(where)
        .order_by(col(CheckpointRow.created_at))
        .offset(offset)
        .limit(limit)
    ).all()
    return {
        "checkpoints": [checkpoint_json(r) for r in rows],
        "cursor": {"offset": offset, "limit": limit, "total_count": total},
    }


@router.get("/training_runs/{run_id:path}", **returns(TrainingRun))
async def get_training_run(
    run_id: str, who: PrincipalDep, db: DbDep, access_scope: Scope = "owned"
) -> dict:
    """A run by id, or by any tinker:// / twinkle:// checkpoint path inside it."""
    purge_expired_checkpoints(db)
    return run_json(db, visible_run(db, who, run_id, access_scope), viewer=who.user_id)


@router.get("/checkpoints", **returns(CheckpointsListResponse))
async def list_user_checkpoints(
    who: PrincipalDep,
    db: DbDep,
    limit: int = Query(100, ge=1, le=1000),
    offset: int = Query(0, ge=0, le=DB_INT_MAX),
) -> dict:
    """All your kept checkpoints, newest first."""
    purge_expired_checkpoints(db)
    where = (CheckpointRow.user_id == who.user_id) & (CheckpointRow.ephemeral == False)  # noqa: E712
    total = db.exec(select(func.count()).select_from(CheckpointRow).where(where)).one()
    rows = db.exec(
        select(CheckpointRow)
        .where(where)
        .order_by(col(CheckpointRow.created_at).desc())
        .offset(offset)
        .limit(limit)
    ).all()
    return {
        "checkpoints": [checkpoint_json(r) for r in rows],
        "cursor": {"offset": offset, "limit": limit, "total_count": total},
    }


@router.delete(
    "/training_runs/{run_id}/checkpoints/{checkpoint_id:path}", **returns(DeleteCheckpointResponse)
)
async def delete_run_checkpoint(
    run_id: str, checkpoint_id: str, who: PrincipalDep, db: DbDep, quotas: QuotasDep
) -> dict:
    """Delete one of your checkpoints and its files."""
    owned_run(db, who, run_id)
    parsed = parse_path(f"tinker://{run_id}/{checkpoint_id}", "checkpoint_id")
    row = db.exec(
        select(CheckpointRow).where(CheckpointRow.tinker_path == parsed.tinker_path)
    ).first()
    if row is None or row.user_id != who.user_id:
        raise NotFoundError(f"checkpoint_id: checkpoint {checkpoint_id!r} not found")
    delete_checkpoint(db, row)
    await quotas.release_checkpoint(who.user_id, who.org_id, parsed.tinker_path)
    return {"deleted": parsed.tinker_path}
