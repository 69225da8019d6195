"""Tinker save endpoints: save_weights (training state) and save_weights_for_sampler (named or
ephemeral, backing a sampler), and the save steps save_weights_external uses too.

A save runs in three steps: `reserve_save` (before submit: refuse an existing name without
overwrite, reserve the checkpoint count / bytes quotas, pick a fresh directory), `run_save` (in the
future, in the model's seq_id order in the Trainer: write the state, then commit the real size and
record usage) and `record_save` (the checkpoint row, replacing an overwritten one, and the sampler
an ephemeral save backs). A refused save still passes its seq_id (`sequenced.submit_sequenced`).
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path

from fastapi import APIRouter
from sqlalchemy import Connection, Engine
from sqlmodel import Session, col, select

from gateway.db.tables import CheckpointRow, SamplingSessionRow, TrainingRunRow, utcnow
from gateway.deps import owned_run
from gateway.errors import InvalidRequestError
from gateway.futures.store import fingerprint
from gateway.runs.checkpoints import ParsedPath, new_storage_dir, validate_name
from gateway.tinker_api.schemas import (
    FutureResponse,
    SaveWeightsForSamplerRequest,
    SaveWeightsRequest,
    returns,
)
from gateway.tinker_api.sequenced import Run, Tinker, TinkerDep, future_json, submit_sequenced

router = APIRouter(prefix="/api/v1")
#: ephemeral sampler weights expire after a day: they only back that sampling session
EPHEMERAL_TTL_S = 86400


@dataclass(frozen=True)
class SaveSpec:
    """What a save writes: ``kind`` is "training" (weights/), "sampler" or "external"."""

    kind: str
    name: str
    overwrite: bool
    ttl_seconds: int | None
    user_metadata: dict | None
    include_optimizer: bool
    ephemeral: bool = False
    #: an ephemeral save creates this sampling session, and the future answers its id
    sampling_session_id: str | None = None
    #: an export encrypted to these age recipients (gateway/tinker_api/exports.py)
    age_recipients: tuple[str, ...] = ()


@dataclass(frozen=True)
class Reservation:
    """A save accepted before submit: its path, fresh directory, and whether it replaces one."""

    parsed: ParsedPath
    directory: Path
    replaces: bool
    expires_at: datetime | None


async def reserve_save(t: Tinker, run: TrainingRunRow, spec: SaveSpec) -> Reservation:
    """Refuse an existing name without overwrite (400), reserve the checkpoint quotas of a kept
    save (403 at a cap), and make the directory. Both refusals fail the seq_id in order."""
    parsed = ParsedPath(run.id, spec.kind, spec.name)
    existing = t.db.exec(
        select(CheckpointRow).where(CheckpointRow.tinker_path == parsed.tinker_path)
    ).first()
    if existing is not None and not spec.overwrite and not spec.ephemeral:
        raise InvalidRequestError(
            f"path: checkpoint {parsed.tinker_path} already exists; "
            "pass overwrite=True to replace it"
        )
    if not spec.ephemeral:  # the run's last checkpoint size estimates this one's
        last = t.db.exec(
            select(CheckpointRow.size_bytes)
            .where(CheckpointRow.run_id == run.id)
            .order_by(col(CheckpointRow.created_at).desc())
        ).first()
        await t.quotas.reserve_checkpoint(t.who, parsed.tinker_path, int(last or 0), t.db)
    directory = new_storage_dir(t.settings.data_dir, t.who.user_id, parsed)
    directory.parent.mkdir(parents=True, exist_ok=True)
    expires = None
    if spec.ttl_seconds is not None:
        expires = utcnow() + timedelta(seconds=spec.ttl_seconds)
    return Reservation(parsed, directory, existing is not None, expires)


async def run_save(
    t: Tinker, run: TrainingRunRow, seq_id: int, spec: SaveSpec, res: Reservation
) -> int:
    """Write the state in seq order; then commit its real size to the quotas and record usage
    (a failed save releases a fresh reservation). Returns the size in bytes."""
    who, path = t.who, res.parsed.tinker_path
    try:
        size = await t.engine.trainer(run.base_model).save_state(
            run.id,
            seq_id=seq_id,
            directory=str(res.directory),
            include_optimizer=spec.include_optimizer,
            age_recipients=spec.age_recipients,
        )
    except BaseException:
        if not spec.ephemeral and not res.replaces:
            await t.quotas.release_checkpoint(who.user_id, who.org_id, path)
        raise
    if not spec.ephemeral:
        await t.quotas.commit_checkpoint(who.user_id, who.org_id, path, size)
        t.usage.record(
            user_id=who.user_id,
            org_id=who.org_id,
            kind="checkpoint",
            quantity=1,
            session_id=run.session_id,
            base_model=run.base_model,
        )
    return size


def record_save(
    bind: Engine | Connection,
    user_id: int,
    run: TrainingRunRow,
    spec: SaveSpec,
    res: Reservation,
    size: int,
) -> None:
    """The checkpoint row (an overwritten one and its files are removed), and the sampling session
    an ephemeral save backs. Its own DB session: the request's is closed by now."""
    path = res.parsed.tinker_path
    with Session(bind) as s:
        old = s.exec(select(CheckpointRow).where(CheckpointRow.tinker_path == path)).first()
        if old is not None:
            shutil.rmtree(old.storage_dir, ignore_errors=True)
            s.delete(old)
            s.flush()
        s.add(
            CheckpointRow(
                run_id=run.id,
                user_id=user_id,
                kind=spec.kind,
                name=spec.name,
                tinker_path=path,
                storage_dir=str(res.directory),
                size_bytes=size,
                ephemeral=spec.ephemeral,
                user_metadata=spec.user_metadata or {},
                expires_at=res.expires_at,
            )
        )
        if spec.sampling_session_id is not None:
            s.add(
                SamplingSessionRow(
                    id=spec.sampling_session_id,
                    session_id=run.session_id,
                    user_id=user_id,
                    base_model=run.base_model,
                    model_path=path,
                    adapter_dir=str(res.directory),
                )
            )
        s.commit()


def save_result(spec: SaveSpec, res: Reservation, size: int) -> dict:
    """The future's JSON result, per save route."""
    if spec.sampling_session_id is not None:
        return {"sampling_session_id": spec.sampling_session_id}
    if spec.kind == "external":
        return {"path": res.parsed.tinker_path, "size_bytes": size}
    rtype = "save_weights" if spec.kind == "training" else "save_weights_for_sampler"
    return {"path": res.parsed.tinker_path, "type": rtype}


async def prepare_save(t: Tinker, run: TrainingRunRow, seq_id: int, spec: SaveSpec) -> Run:
    """Reserve now; the returned coroutine runs and records the save."""
    res = await reserve_save(t, run, spec)
    bind = t.db.get_bind()

    async def run_() -> tuple[str, object]:
        size = await run_save(t, run, seq_id, spec, res)
        record_save(bind, t.who.user_id, run, spec, res, size)
        return "json", save_result(spec, res, size)

    return run_


@router.post("/save_weights", **returns(FutureResponse))
async def save_weights(req: SaveWeightsRequest, t: TinkerDep) -> dict:
    """Save the model's training state (weights and optimizer) under weights/<path>."""
    fp = fingerprint(req.model_dump(mode="json"))
    run = owned_run(t.db, t.who, req.model_id, live=True)

    async def prepare() -> Run:
        spec = SaveSpec(
            kind="training",
            name=validate_name(req.path or "", "path"),
            overwrite=req.overwrite,
            ttl_seconds=req.ttl_seconds,
            user_metadata=req.user_metadata,
            include_optimizer=True,
        )
        return await prepare_save(t, run, req.seq_id, spec)

    rec = await submit_sequenced(t, run, req.seq_id, fp, "save", prepare)
    return future_json(rec, run.id)


@router.post("/save_weights_for_sampler", **returns(FutureResponse))
async def save_weights_for_sampler(req: SaveWeightsForSamplerRequest, t: TinkerDep) -> dict:
    """Save sampler weights: named (sampler_weights/<path>) or ephemeral, backing a new sampler."""
    fp = fingerprint(req.model_dump(mode="json"))
    run = owned_run(t.db, t.who, req.model_id, live=True)

    async def prepare() -> Run:
        return await prepare_save(t, run, req.seq_id, _sampler_spec(req, run))

    rec = await submit_sequenced(t, run, req.seq_id, fp, "save", prepare)
    return future_json(rec, run.id)


def _sampler_spec(req: SaveWeightsForSamplerRequest, run: TrainingRunRow) -> SaveSpec:
    """A named save (overwrites), or an ephemeral one for sampling_session_seq_id."""
    if req.path is not None:
        name = validate_name(req.path, "path")
        return SaveSpec("sampler", name, True, req.ttl_seconds, req.user_metadata, False)
    if req.sampling_session_seq_id is None:
        raise InvalidRequestError(
            "path: give a name, or sampling_session_seq_id for an ephemeral save"
        )
    return SaveSpec(
        kind="sampler",
        name=f"ephemeral-{req.sampling_session_seq_id}",
        overwrite=True,
        ttl_seconds=EPHEMERAL_TTL_S,
        user_metadata=req.user_metadata,
        include_optimizer=False,
        ephemeral=True,
        sampling_session_id=f"{run.session_id}:sample:{req.sampling_session_seq_id}",
    )
