"""Tinker REST endpoints that act on one checkpoint: publish / unpublish, TTL, weights_info, and
copy_weights.

* Publishing makes a checkpoint readable by every user of this server (load it, sample from it,
  see its run with ``access_scope=accessible``); only the owner may publish, unpublish, delete or
  change its TTL.
* A TTL sets ``expires_at``; an expired checkpoint is deleted (files and row) the first time anyone
  looks at it, or by the background sweep, and answers 404 from then on. ``ttl_seconds: null``
  removes the expiry.
* copy_weights makes a new training run (in a new session of the destination project, or in the
  given session slot) holding a copy of the checkpoint. Files are hard-linked, so no bytes are
  duplicated and deleting either copy leaves the other intact. The copy cannot be trained on (no
  adapter is created for it); load it with create_training_client_from_state to continue training.
"""

from __future__ import annotations

import os
import shutil
import uuid
from datetime import timedelta
from pathlib import Path

from fastapi import APIRouter
from pydantic import Field

from gateway.db.tables import CheckpointRow, SessionRow, TrainingRunRow, utcnow
from gateway.deps import MAX_TTL_S, DbDep, PrincipalDep, SettingsDep, owned_session
from gateway.errors import InvalidRequestError, NotFoundError
from gateway.quotas import QuotasDep
from gateway.runs.checkpoints import ParsedPath, new_storage_dir, parse_path, readable_checkpoint
from gateway.tinker_api.schemas import (
    Checkpoint,
    CopyWeightsResponse,
    WeightsInfoResponse,
    WireRequest,
    returns,
)
from gateway.training.queries import checkpoint_json

router = APIRouter(prefix="/api/v1")


class TtlRequest(WireRequest):
    ttl_seconds: int | None = Field(None, ge=1, le=MAX_TTL_S)


class WeightsInfoRequest(WireRequest):
    tinker_path: str


class CopyWeightsRequest(WireRequest):
    source_path: str
    destination_project_id: str | None = Field(None, max_length=128)
    session_id: str | None = None
    model_seq_id: int | None = Field(None, ge=0)
    ttl_seconds: int | None = Field(None, ge=1, le=MAX_TTL_S)


def visible_checkpoint(db, who, run_id: str, checkpoint_id: str) -> CheckpointRow:
    """A checkpoint by (run, ``weights/<name>``-style id) that the caller owns or that is public."""
    return readable_checkpoint(
        db, who.user_id, f"tinker://{run_id}/{checkpoint_id}", "checkpoint_id"
    )


def owned_checkpoint(db, who, run_id: str, checkpoint_id: str) -> CheckpointRow:
    row = visible_checkpoint(db, who, run_id, checkpoint_id)
    if row.user_id != who.user_id or row.ephemeral:
        raise NotFoundError(f"checkpoint_id: checkpoint {checkpoint_id!r} not found")
    return row


@router.post(
    "/training_runs/{run_id}/checkpoints/{checkpoint_id:path}/publish", **returns(Checkpoint)
)
async def publish(run_id: str, checkpoint_id: str, who: PrincipalDep, db: DbDep) -> dict:
    """Make one of your checkpoints readable by every user (RestClient.publish_checkpoint)."""
    return _set_public(db, owned_checkpoint(db, who, run_id, checkpoint_id), True)


@router.delete(
    "/training_runs/{run_id}/checkpoints/{checkpoint_id:path}/publish", **returns(Checkpoint)
)
async def unpublish(run_id: str, checkpoint_id: str, who: PrincipalDep, db: DbDep) -> dict:
    """Make a published checkpoint private again."""
    return _set_public(db, owned_checkpoint(db, who, run_id, checkpoint_id), False)


def _set_public(db, row: CheckpointRow, public: bool) -> dict:
    row.public = public
    db.add(row)
    db.commit()
    db.refresh(row)
    return checkpoint_json(row)


@router.put("/training_runs/{run_id}/checkpoints/{checkpoint_id:path}/ttl", **returns(Checkpoint))
async def set_ttl(
    run_id: str, checkpoint_id: str, req: TtlRequest, who: PrincipalDep, db: DbDep
) -> dict:
    """Set (or clear, with null) a checkpoint's time to live, counted from now."""
    row = owned_checkpoint(db, who, run_id, checkpoint_id)
    row.expires_at = (
        None if req.ttl_seconds is None else utcnow() + timedelta(seconds=req.ttl_seconds)
    )
    db.add(row)
    db.commit()
    db.refresh(row)
    return checkpoint_json(row)


@router.post("/weights_info", **returns(WeightsInfoResponse))
async def weights_info(req: WeightsInfoRequest, who: PrincipalDep, db: DbDep) -> dict:
    """The base model and LoRA shape of a readable checkpoint path."""
    row = readable_checkpoint(db, who.user_id, req.tinker_path, "tinker_path")
    run = db.get(TrainingRunRow, row.run_id)
    if run is None:
        raise NotFoundError(f"tinker_path: {req.tinker_path} not found")
    return {
        "base_model": run.base_model,
        "is_lora": True,
        "lora_rank": run.lora_rank,
        "train_unembed": run.train_unembed,
        "train_mlp": run.train_mlp,
        "train_attn": run.train_attn,
        "optimizer_config": {"type": "adamw"},
    }


def _link_tree(src: Path, dst: Path) -> None:
    """Copy a checkpoint folder by hard links (a plain copy across file systems)."""
    tmp = dst.with_name(dst.name + ".tmp")
    tmp.mkdir(parents=True)
    for f in src.iterdir():
        try:
            os.link(f, tmp / f.name)
        except OSError:
            shutil.copy2(f, tmp / f.name)
    os.rename(tmp, dst)


@router.post("/copy_weights", **returns(CopyWeightsResponse))
async def copy_weights(
    req: CopyWeightsRequest,
    who: PrincipalDep,
    db: DbDep,
    settings: SettingsDep,
    quotas: QuotasDep,
) -> dict:
    """Copy a readable checkpoint into one of your runs (hard links; quotas apply)."""
    src = readable_checkpoint(db, who.user_id, req.source_path, "source_path")
    if src.ephemeral:
        raise InvalidRequestError("source_path: ephemeral sampler weights cannot be copied")
    source_run = db.get(TrainingRunRow, src.run_id)
    if source_run is None:
        raise NotFoundError(f"source_path: {req.source_path} not found")
    session, run_id = _copy_destination(db, who, req)
    db.add(
        TrainingRunRow(
            id=run_id,
            session_id=session.id,
            user_id=who.user_id,
            **source_run.adapter_shape(),
            user_metadata={"copied_from": src.tinker_path},
        )
    )
    db.flush()  # the run row first: the checkpoint row's foreign key points at it
    target = await _copy_checkpoint(
        db, who, quotas, settings.data_dir, src, run_id, req.ttl_seconds
    )
    return {"tinker_path": target.tinker_path}


def _copy_destination(db, who, req: CopyWeightsRequest) -> tuple[SessionRow, str]:
    """(session, run id) of the copy: the given session slot, or run 0 of a new session in the
    destination project."""
    if req.session_id is not None:
        if req.model_seq_id is None:
            raise InvalidRequestError("model_seq_id: required together with session_id")
        session = owned_session(db, who, req.session_id)
        run_id = f"{session.id}:train:{req.model_seq_id}"
        if db.get(TrainingRunRow, run_id) is not None:
            raise InvalidRequestError(f"model_seq_id: run {run_id} already exists in this session")
        return session, run_id
    if not req.destination_project_id:
        raise InvalidRequestError(
            "destination_project_id: give a destination project, or session_id and model_seq_id"
        )
    # A session of its own, already finished: it only owns the copy (never heartbeats).
    session = SessionRow(
        id=f"sess-{uuid.uuid4().hex[:16]}",
        user_id=who.user_id,
        project_id=req.destination_project_id,
        display_name=f"copy of {parse_path(req.source_path, 'source_path').tinker_path}",
        finished_at=utcnow(),
        finish_reason="copy",
    )
    db.add(session)
    db.flush()
    return session, f"{session.id}:train:0"


async def _copy_checkpoint(
    db, who, quotas, data_dir: Path, src: CheckpointRow, run_id: str, ttl_seconds: int | None
) -> ParsedPath:
    """Hard-link ``src`` into run ``run_id`` and record it. A copy is a checkpoint of the
    caller's: it counts toward their count and bytes caps (403)."""
    target = ParsedPath(run_id, src.kind, src.name)
    await quotas.reserve_checkpoint(who, target.tinker_path, int(src.size_bytes or 0), db)
    directory = new_storage_dir(data_dir, who.user_id, target)
    _link_tree(Path(src.storage_dir), directory)
    db.add(
        CheckpointRow(
            run_id=run_id,
            user_id=who.user_id,
            kind=src.kind,
            name=src.name,
            tinker_path=target.tinker_path,
            storage_dir=str(directory),
            size_bytes=src.size_bytes,
            user_metadata=dict(src.user_metadata or {}),
            expires_at=None if ttl_seconds is None else utcnow() + timedelta(seconds=ttl_seconds),
        )
    )
    db.commit()
    await quotas.commit_checkpoint(who.user_id, who.org_id, target.tinker_path, src.size_bytes)
    return target
