"""Tinker REST endpoints over training runs and their checkpoints (RestClient)."""

from __future__ import annotations

from datetime import datetime

from fastapi import APIRouter, Query
from sqlmodel import col, func, select

from gateway.checkpoints import SEGMENT_OF_KIND, delete_checkpoint, parse_path
from gateway.deps import DbDep, PrincipalDep, owned_run
from gateway.errors import NotFoundError
from gateway.tables import CheckpointRow, TrainingRunRow

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


def run_json(db, run: TrainingRunRow, owner_name: str) -> dict:
    def last(kind: str) -> dict | None:
        row = db.exec(
            select(CheckpointRow)
            .where(
                CheckpointRow.run_id == run.id,
                CheckpointRow.kind == kind,
                CheckpointRow.ephemeral == False,
            )  # noqa: E712
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


@router.get("/training_runs")
async def list_training_runs(
    who: PrincipalDep,
    db: DbDep,
    limit: int = Query(20, ge=1, le=1000),
    offset: int = Query(0, ge=0),
    access_scope: str = "owned",
) -> dict:
    where = TrainingRunRow.user_id == who.user_id
    total = db.exec(select(func.count()).select_from(TrainingRunRow).where(where)).one()
    rows = db.exec(
        select(TrainingRunRow)
        .where(where)
        .order_by(col(TrainingRunRow.created_at).desc())
        .offset(offset)
        .limit(limit)
    ).all()
    return {
        "training_runs": [run_json(db, r, who.user_name) for r in rows],
        "cursor": {"offset": offset, "limit": limit, "total_count": total},
    }


@router.get("/training_runs/{run_id}")
async def get_training_run(run_id: str, who: PrincipalDep, db: DbDep) -> dict:
    if run_id.startswith(("tinker://", "twinkle://")):
        run_id = parse_path(run_id).run_id
    return run_json(db, owned_run(db, who, run_id), who.user_name)


@router.get("/training_runs/{run_id}/checkpoints")
async def list_run_checkpoints(run_id: str, who: PrincipalDep, db: DbDep) -> dict:
    owned_run(db, who, run_id)
    rows = db.exec(
        select(CheckpointRow)
        .where(CheckpointRow.run_id == run_id, CheckpointRow.ephemeral == False)  # noqa: E712
        .order_by(col(CheckpointRow.created_at))
    ).all()
    return {"checkpoints": [checkpoint_json(r) for r in rows]}


@router.get("/checkpoints")
async def list_user_checkpoints(
    who: PrincipalDep,
    db: DbDep,
    limit: int = Query(100, ge=1, le=1000),
    offset: int = Query(0, ge=0),
) -> dict:
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


@router.delete("/training_runs/{run_id}/checkpoints/{checkpoint_id:path}")
async def delete_run_checkpoint(
    run_id: str, checkpoint_id: str, who: PrincipalDep, db: DbDep
) -> dict:
    owned_run(db, who, run_id)
    parsed = parse_path(f"tinker://{run_id}/{checkpoint_id}", "checkpoint_id")
    row = db.exec(
        select(CheckpointRow).where(CheckpointRow.tinker_path == parsed.tinker_path)
    ).first()
    if row is None or row.user_id != who.user_id:
        raise NotFoundError(f"checkpoint_id: checkpoint {checkpoint_id!r} not found")
    delete_checkpoint(db, row)
    return {"deleted": parsed.tinker_path}
