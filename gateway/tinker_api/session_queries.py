"""Tinker REST endpoints over sessions (RestClient): list, get, assign a project.

Sessions are listed newest first, finished and expired ones included (their runs and samplers are
still listed). Trace export: session_traces.py; search: session_search.py.
"""

from __future__ import annotations

from typing import Literal

from fastapi import APIRouter, Query
from pydantic import Field
from sqlmodel import col, select

from gateway.db.tables import SamplingSessionRow, SessionRow, TrainingRunRow
from gateway.deps import DB_INT_MAX, DbDep, PrincipalDep
from gateway.errors import NotFoundError
from gateway.tinker_api.schemas import (
    AssignProjectResponse,
    GetSessionResponse,
    ListSessionsResponse,
    WireRequest,
    returns,
)

router = APIRouter(prefix="/api/v1")


class AssignProjectRequest(WireRequest):
    project_id: str = Field(min_length=1, max_length=128)


def _session(db, who, session_id: str) -> SessionRow:
    row = db.get(SessionRow, session_id)
    if row is None or row.user_id != who.user_id:
        raise NotFoundError(f"session_id: session {session_id!r} not found")
    return row


@router.get("/sessions", **returns(ListSessionsResponse))
async def list_sessions(
    who: PrincipalDep,
    db: DbDep,
    limit: int = Query(20, ge=1, le=1000),
    offset: int = Query(0, ge=0, le=DB_INT_MAX),
    access_scope: Literal["owned", "accessible"] = "owned",
) -> dict:
    """Your session ids, newest first."""
    rows = db.exec(
        select(SessionRow.id)
        .where(SessionRow.user_id == who.user_id)
        .order_by(col(SessionRow.created_at).desc(), col(SessionRow.id))
        .offset(offset)
        .limit(limit)
    ).all()
    return {"sessions": list(rows)}


@router.get("/sessions/{session_id}", **returns(GetSessionResponse))
async def get_session(
    session_id: str,
    who: PrincipalDep,
    db: DbDep,
    access_scope: Literal["owned", "accessible"] = "owned",
) -> dict:
    """A session's training runs, samplers, metadata and status."""
    row = _session(db, who, session_id)
    runs = db.exec(
        select(TrainingRunRow.id)
        .where(TrainingRunRow.session_id == row.id)
        .order_by(col(TrainingRunRow.created_at))
    ).all()
    samplers = db.exec(
        select(SamplingSessionRow.id)
        .where(SamplingSessionRow.session_id == row.id)
        .order_by(col(SamplingSessionRow.created_at))
    ).all()
    return {
        "training_run_ids": list(runs),
        "sampler_ids": list(samplers),
        "user_metadata": {str(k): str(v) for k, v in (row.user_metadata or {}).items()} or None,
        "display_name": row.display_name,
        "project_id": row.project_id,
        "status": "expired"
        if row.finish_reason == "expired"
        else ("finished" if row.finished_at else "active"),
    }


@router.put("/sessions/{session_id}/project", **returns(AssignProjectResponse))
async def assign_session_project(
    session_id: str, req: AssignProjectRequest, who: PrincipalDep, db: DbDep
) -> dict:
    """Put a session in a project (a label that filters list_training_runs)."""
    row = _session(db, who, session_id)
    row.project_id = req.project_id
    db.add(row)
    db.commit()
    return {"session_id": row.id, "project_id": row.project_id}
