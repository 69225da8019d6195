"""Reading training runs and checkpoints: what a caller may see, and the one JSON form of a run
and a checkpoint that every dialect answers (the native routes add ``twinkle_path``).

Owns `served_models` (what the server trains and samples), `list_runs`, `get_run`,
`visible_run`, `list_run_checkpoints`, `list_user_checkpoints`, `run_json`, `checkpoint_json`.
Expired checkpoints are purged before any listing, so they never show. ``access_scope``
"owned" is the caller's runs; "accessible" adds runs with a published checkpoint.
"""

from __future__ import annotations

from datetime import datetime
from typing import Literal

from sqlmodel import Session, col, func, select

from gateway.accounts.keys import Principal
from gateway.config import ServerConfig
from gateway.db.tables import CheckpointRow, SessionRow, TrainingRunRow, UserRow
from gateway.engine_client import EngineClient
from gateway.errors import NotFoundError
from gateway.runs.checkpoints import PUBLISHED_OWNER, SEGMENT_OF_KIND, parse_path
from gateway.runs.expiry import purge_expired_checkpoints

Scope = Literal["owned", "accessible"]


async def served_models(config: ServerConfig, engine: EngineClient) -> list[dict]:
    """The models served here, with their context length and max LoRA rank."""
    models = []
    for m in config.models:
        info = await engine.trainer(m.name).info()
        models.append(
            {
                "model_name": m.name,
                "max_context_length": m.max_context_length or info.get("max_context_length"),
                "max_lora_rank": info["max_lora_rank"],
                "trainable": True,
                "sampleable": True,
            }
        )
    return models


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


def run_json(db, run: TrainingRunRow, viewer: int) -> dict:
    """The run as user ``viewer`` sees it: another user's (published) run names no owner."""
    owner_name = PUBLISHED_OWNER
    if run.user_id == viewer:
        owner = db.get(UserRow, run.user_id)
        owner_name = owner.name if owner else str(viewer)

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


def _page(db: Session, model, where, order, offset: int, limit: int) -> tuple[list, int]:
    """One page of rows and the total count."""
    total = db.exec(select(func.count()).select_from(model).where(where)).one()
    rows = db.exec(select(model).where(where).order_by(order).offset(offset).limit(limit)).all()
    return list(rows), total


def _cursor(offset: int, limit: int, total: int) -> dict:
    return {"offset": offset, "limit": limit, "total_count": total}


def list_runs(
    db: Session,
    who: Principal,
    offset: int,
    limit: int,
    access_scope: str = "owned",
    project_id: str | None = None,
) -> dict:
    """The caller's runs (scope accessible: also runs with a published checkpoint), newest
    first; ``project_id`` keeps those of that project's sessions."""
    purge_expired_checkpoints(db)
    where = _runs_where(who.user_id, access_scope)
    if project_id is not None:
        where = where & col(TrainingRunRow.session_id).in_(
            select(SessionRow.id).where(SessionRow.project_id == project_id)
        )
    order = col(TrainingRunRow.created_at).desc()
    rows, total = _page(db, TrainingRunRow, where, order, offset, limit)
    return {
        "training_runs": [run_json(db, r, viewer=who.user_id) for r in rows],
        "cursor": _cursor(offset, limit, total),
    }


def get_run(db: Session, who: Principal, run_id: str, access_scope: str = "owned") -> dict:
    """A run by id, or by any tinker:// / twinkle:// checkpoint path inside it."""
    purge_expired_checkpoints(db)
    return run_json(db, visible_run(db, who, run_id, access_scope), viewer=who.user_id)


def list_run_checkpoints(
    db: Session, who: Principal, run_id: str, offset: int = 0, limit: int = 1000
) -> dict:
    """The checkpoints of a run the caller can see, oldest first."""
    purge_expired_checkpoints(db)
    visible_run(db, who, run_id)
    where = (col(CheckpointRow.run_id) == run_id) & _visible(who.user_id)
    order = col(CheckpointRow.created_at)
    rows, total = _page(db, CheckpointRow, where, order, offset, limit)
    return {
        "checkpoints": [checkpoint_json(r) for r in rows],
        "cursor": _cursor(offset, limit, total),
    }


def list_user_checkpoints(db: Session, who: Principal, offset: int, limit: int) -> dict:
    """All the caller's kept checkpoints, newest first."""
    purge_expired_checkpoints(db)
    where = (CheckpointRow.user_id == who.user_id) & (CheckpointRow.ephemeral == False)  # noqa: E712
    order = col(CheckpointRow.created_at).desc()
    rows, total = _page(db, CheckpointRow, where, order, offset, limit)
    return {
        "checkpoints": [checkpoint_json(r) for r in rows],
        "cursor": _cursor(offset, limit, total),
    }
