"""Tinker REST endpoints that act on one checkpoint: publish / unpublish, TTL, weights_info, and
copy_weights.

* Publishing makes a checkpoint readable by every user of this server (load it, sample from it,
  see its run with ``access_scope=accessible``); only the owner may publish, unpublish, delete or
  change its TTL.
* A TTL sets ``expires_at``; an expired checkpoint is deleted (files and row) the first time anyone
  looks at it, or by the background sweep, and answers 404 from then on. ``ttl_seconds: null``
  removes the expiry.
* copy_weights makes a new training run (in a new session of the destination project, or in the
  given session slot) holding a copy of the checkpoint, saved like any save
  (`gateway.training.checkpoints`: quotas, usage ledger, row). Files are hard-linked, so no bytes
  are duplicated and deleting either copy leaves the other intact. The copy cannot be trained on (no
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

from gateway.context import ContextDep
from gateway.db.tables import CheckpointRow, SessionRow, TrainingRunRow, utcnow
from gateway.deps import MAX_TTL_S, DbDep, PrincipalDep, owned_session
from gateway.errors import InvalidRequestError, NotFoundError
from gateway.runs.checkpoints import parse_path, readable_checkpoint
from gateway.tinker_api.schemas import (
    Checkpoint,
    CopyWeightsResponse,
    WeightsInfoResponse,
    WireRequest,
    returns,
)
from gateway.training import checkpoints
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
async def copy_weights(req: CopyWeightsRequest, t: ContextDep) -> dict:
    """Copy a readable checkpoint into one of your runs (hard links). A copy is a save of the
    caller's (`gateway.training.checkpoints`): under their checkpoint count and bytes caps
    (403, before any row or file is made) and in the usage ledger."""
    db, who = t.db, t.who
    src = readable_checkpoint(db, who.user_id, req.source_path, "source_path")
    if src.ephemeral:
        raise InvalidRequestError("source_path: ephemeral sampler weights cannot be copied")
    source_run = db.get(TrainingRunRow, src.run_id)
    if source_run is None:
        raise NotFoundError(f"source_path: {req.source_path} not found")
    session, run_id = _copy_destination(db, who, req)
    run = TrainingRunRow(
        id=run_id,
        session_id=session.id,
        user_id=who.user_id,
        **source_run.adapter_shape(),
        user_metadata={"copied_from": src.tinker_path},
    )
    spec = checkpoints.SaveSpec(
        kind=src.kind,
        name=src.name,
        overwrite=False,
        ttl_seconds=req.ttl_seconds,
        user_metadata=dict(src.user_metadata or {}),
        include_optimizer=False,
    )
    src_dir, size = Path(src.storage_dir), int(src.size_bytes or 0)
    res = await checkpoints.reserve(t, run, spec, estimate=size)
    db.add(session)
    db.add(run)
    db.commit()  # the run row first: the checkpoint row's foreign key points at it

    async def link() -> int:
        _link_tree(src_dir, res.directory)
        return size

    try:
        size = await checkpoints.write(t, run, spec, res, link)
    except BaseException:
        db.delete(run)
        if session.finish_reason == "copy":  # the session made for this copy only
            db.delete(session)
        db.commit()
        raise
    checkpoints.record(db.get_bind(), who.user_id, run, spec, res, size)
    return {"tinker_path": res.parsed.tinker_path}


def _copy_destination(db, who, req: CopyWeightsRequest) -> tuple[SessionRow, str]:
    """(session, run id) of the copy: the given session slot, or run 0 of a new session (not
    yet added) in the destination project."""
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
    return session, f"{session.id}:train:0"
