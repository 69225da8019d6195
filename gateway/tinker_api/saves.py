"""Tinker save endpoints: save_weights (training state), save_weights_for_sampler (named or
ephemeral, backing a sampler), and the shared `_save_future` that save_weights_external uses too.

A save runs in the model's seq_id order in the Trainer (into a fresh directory), then records the
checkpoint row, replacing an overwritten one; a rejected save still passes its seq_id.
"""

from __future__ import annotations

import shutil
from datetime import timedelta

from fastapi import APIRouter, Request
from sqlmodel import Session, col, select

from gateway.db.tables import CheckpointRow, SamplingSessionRow, TrainingRunRow, utcnow
from gateway.deps import DbDep, EngineDep, FuturesDep, PrincipalDep, SettingsDep, owned_run
from gateway.errors import InvalidRequestError, QuotaExceededError
from gateway.futures.store import FutureRecord, fingerprint
from gateway.quotas import QuotasDep
from gateway.runs.checkpoints import ParsedPath, new_storage_dir, validate_name
from gateway.tinker_api.schemas import SaveWeightsForSamplerRequest, SaveWeightsRequest
from gateway.tinker_api.training import _touch, future_json, reject_in_order

router = APIRouter(prefix="/api/v1")


async def _save_future(
    *,
    who,
    quotas,
    usage_ledger,
    db,
    engine,
    futures,
    settings,
    run: TrainingRunRow,
    seq_id: int,
    kind: str,
    name: str,
    overwrite: bool,
    ttl_seconds: int | None,
    user_metadata: dict | None,
    include_optimizer: bool,
    ephemeral: bool = False,
    result_key: str = "path",
    sampling_session_id: str | None = None,
    fp: str | None = None,
) -> FutureRecord:
    """Save in seq order, then record the checkpoint row (replacing an overwritten one).

    A non-ephemeral save reserves the checkpoint count / bytes quotas first (a denial fails this
    seq_id in order, as a 403 in the future), commits the real size after the save, and records
    it in the usage ledger."""
    parsed = ParsedPath(run.id, kind, name)
    existing = db.exec(
        select(CheckpointRow).where(CheckpointRow.tinker_path == parsed.tinker_path)
    ).first()
    if existing is not None and not overwrite and not ephemeral:
        return reject_in_order(
            futures,
            engine,
            who,
            run,
            seq_id,
            f"path: checkpoint {parsed.tinker_path} already exists; "
            "pass overwrite=True to replace it",
            kind="save",
            fp=fp,
        )
    if not ephemeral:
        last = db.exec(
            select(CheckpointRow.size_bytes)
            .where(CheckpointRow.run_id == run.id)
            .order_by(col(CheckpointRow.created_at).desc())
        ).first()
        try:
            await quotas.reserve_checkpoint(who, parsed.tinker_path, int(last or 0), db)
        except QuotaExceededError as exc:
            return reject_in_order(futures, engine, who, run, seq_id, str(exc), kind="save", fp=fp)
    directory = new_storage_dir(settings.data_dir, who.user_id, parsed)
    directory.parent.mkdir(parents=True, exist_ok=True)
    expires = None
    if ttl_seconds is not None:
        expires = utcnow() + timedelta(seconds=ttl_seconds)

    async def run_() -> tuple[str, object]:
        try:
            size = await engine.trainer(
                run.base_model, "save_state", run.id, seq_id, str(directory), include_optimizer
            )
        except BaseException:
            if not ephemeral and existing is None:
                await quotas.release_checkpoint(who.user_id, who.org_id, parsed.tinker_path)
            raise
        if not ephemeral:
            await quotas.commit_checkpoint(who.user_id, who.org_id, parsed.tinker_path, size)
            usage_ledger.record(
                user_id=who.user_id,
                org_id=who.org_id,
                kind="checkpoint",
                quantity=1,
                session_id=run.session_id,
                base_model=run.base_model,
            )
        with Session(db.get_bind()) as s:
            old = s.exec(
                select(CheckpointRow).where(CheckpointRow.tinker_path == parsed.tinker_path)
            ).first()
            if old is not None:
                shutil.rmtree(old.storage_dir, ignore_errors=True)
                s.delete(old)
                s.flush()
            s.add(
                CheckpointRow(
                    run_id=run.id,
                    user_id=who.user_id,
                    kind=kind,
                    name=name,
                    tinker_path=parsed.tinker_path,
                    storage_dir=str(directory),
                    size_bytes=size,
                    ephemeral=ephemeral,
                    user_metadata=user_metadata or {},
                    expires_at=expires,
                )
            )
            if sampling_session_id is not None:
                s.add(
                    SamplingSessionRow(
                        id=sampling_session_id,
                        session_id=run.session_id,
                        user_id=who.user_id,
                        base_model=run.base_model,
                        model_path=parsed.tinker_path,
                        adapter_dir=str(directory),
                    )
                )
            s.commit()
        if result_key == "sampling_session_id":
            return "json", {"sampling_session_id": sampling_session_id}
        if kind == "external":
            return "json", {"path": parsed.tinker_path, "size_bytes": size}
        rtype = "save_weights" if kind == "training" else "save_weights_for_sampler"
        return "json", {"path": parsed.tinker_path, "type": rtype}

    return futures.submit(
        user_id=who.user_id,
        extra={"base_model": run.base_model},
        kind="save",
        run=run_,
        idem_key=(run.id, seq_id),
        fp=fp,
    )


@router.post("/save_weights")
async def save_weights(
    req: SaveWeightsRequest,
    who: PrincipalDep,
    db: DbDep,
    engine: EngineDep,
    futures: FuturesDep,
    settings: SettingsDep,
    quotas: QuotasDep,
    request: Request,
) -> dict:
    fp = fingerprint(req.model_dump(mode="json"))
    run = owned_run(db, who, req.model_id, live=True)
    if (prev := await futures.lookup_idempotent((run.id, req.seq_id), fp)) is not None:
        return future_json(prev, run.id)
    _touch(db, run)
    try:
        name = validate_name(req.path or "", "path")
    except InvalidRequestError as exc:
        rec = reject_in_order(futures, engine, who, run, req.seq_id, str(exc), kind="save", fp=fp)
        return future_json(rec, run.id)
    rec = await _save_future(
        who=who,
        quotas=quotas,
        usage_ledger=request.app.state.usage,
        db=db,
        engine=engine,
        futures=futures,
        settings=settings,
        run=run,
        seq_id=req.seq_id,
        kind="training",
        name=name,
        overwrite=req.overwrite,
        ttl_seconds=req.ttl_seconds,
        user_metadata=req.user_metadata,
        include_optimizer=True,
        fp=fp,
    )
    return future_json(rec, run.id)


@router.post("/save_weights_for_sampler")
async def save_weights_for_sampler(
    req: SaveWeightsForSamplerRequest,
    who: PrincipalDep,
    db: DbDep,
    engine: EngineDep,
    futures: FuturesDep,
    settings: SettingsDep,
    quotas: QuotasDep,
    request: Request,
) -> dict:
    fp = fingerprint(req.model_dump(mode="json"))
    run = owned_run(db, who, req.model_id, live=True)
    if (prev := await futures.lookup_idempotent((run.id, req.seq_id), fp)) is not None:
        return future_json(prev, run.id)
    _touch(db, run)
    common = dict(
        who=who,
        quotas=quotas,
        usage_ledger=request.app.state.usage,
        db=db,
        engine=engine,
        futures=futures,
        settings=settings,
        run=run,
        seq_id=req.seq_id,
        kind="sampler",
        include_optimizer=False,
        user_metadata=req.user_metadata,
        fp=fp,
    )
    if req.path is None:
        if req.sampling_session_seq_id is None:
            rec = reject_in_order(
                futures,
                engine,
                who,
                run,
                req.seq_id,
                "path: give a name, or sampling_session_seq_id for an ephemeral save",
                kind="save",
                fp=fp,
            )
            return future_json(rec, run.id)
        sampler_id = f"{run.session_id}:sample:{req.sampling_session_seq_id}"
        # Ephemeral weights expire with a day's margin; they exist only to back that sampler.
        rec = await _save_future(
            **common,
            name=f"ephemeral-{req.sampling_session_seq_id}",
            overwrite=True,
            ttl_seconds=86400,
            ephemeral=True,
            result_key="sampling_session_id",
            sampling_session_id=sampler_id,
        )
        return future_json(rec, run.id)
    try:
        name = validate_name(req.path, "path")
    except InvalidRequestError as exc:
        rec = reject_in_order(futures, engine, who, run, req.seq_id, str(exc), kind="save", fp=fp)
        return future_json(rec, run.id)
    rec = await _save_future(**common, name=name, overwrite=True, ttl_seconds=req.ttl_seconds)
    return future_json(rec, run.id)
