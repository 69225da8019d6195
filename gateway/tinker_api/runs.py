"""Tinker REST endpoints over training runs and their checkpoints (RestClient): list / get runs
(``access_scope`` owned = yours, accessible = yours plus runs with a published checkpoint), list a
run's checkpoints and all of yours, delete one. The queries are `gateway.training.queries`."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query
from sqlmodel import select

from gateway.db.tables import CheckpointRow
from gateway.deps import DB_INT_MAX, DbDep, PrincipalDep, owned_run
from gateway.errors import NotFoundError
from gateway.quotas import QuotasDep
from gateway.runs.checkpoints import delete_checkpoint, parse_path
from gateway.tinker_api.schemas import (
    CheckpointsListResponse,
    DeleteCheckpointResponse,
    TrainingRun,
    TrainingRunsResponse,
    returns,
)
from gateway.training import queries
from gateway.training.queries import Scope

router = APIRouter(prefix="/api/v1")


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
    return queries.list_runs(db, who, offset, limit, access_scope, project_id)


@router.get("/training_runs/{run_id}/checkpoints", **returns(CheckpointsListResponse))
async def list_run_checkpoints(
    run_id: str,
    who: PrincipalDep,
    db: DbDep,
    limit: Annotated[int, Query(ge=1, le=10000)] = 1000,
    offset: Annotated[int, Query(ge=0, le=DB_INT_MAX)] = 0,
) -> dict:
    """The checkpoints of a training run you can see, oldest first."""
    return queries.list_run_checkpoints(db, who, run_id, offset, limit)


@router.get("/training_runs/{run_id:path}", **returns(TrainingRun))
async def get_training_run(
    run_id: str, who: PrincipalDep, db: DbDep, access_scope: Scope = "owned"
) -> dict:
    """A run by id, or by any tinker:// / twinkle:// checkpoint path inside it."""
    return queries.get_run(db, who, run_id, access_scope)


@router.get("/checkpoints", **returns(CheckpointsListResponse))
async def list_user_checkpoints(
    who: PrincipalDep,
    db: DbDep,
    limit: int = Query(100, ge=1, le=1000),
    offset: int = Query(0, ge=0, le=DB_INT_MAX),
) -> dict:
    """All your kept checkpoints, newest first."""
    return queries.list_user_checkpoints(db, who, offset, limit)


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
