"""Tinker training endpoints: create_model, get_info, forward_backward, optim_step, save_weights,
save_weights_for_sampler, load_weights.

Every sequenced request becomes a future that passes through the Trainer's seq_id ordering, even
when it is rejected (a rejected seq_id must still advance the model's sequence, or every later
request would wait for it).
"""

from __future__ import annotations

import zstandard
from fastapi import APIRouter, Request
from sqlmodel import select

from engine.errors import UserInputError
from engine.protocol import AdamParams, LoraSpec
from gateway.checkpoints import ParsedPath, new_storage_dir, readable_checkpoint, validate_name
from gateway.deps import (
    ConfigDep,
    DbDep,
    EngineDep,
    FuturesDep,
    PrincipalDep,
    SettingsDep,
    owned_run,
    owned_session,
)
from gateway.errors import InvalidRequestError, NotFoundError
from gateway.futures import FutureRecord
from gateway.tables import CheckpointRow, SamplingSessionRow, TrainingRunRow, utcnow
from gateway.tinker_api.proto_codec import decode_forward_backward, encode_forward_backward_output
from gateway.tinker_api.schemas import (
    CreateModelRequest,
    GetInfoRequest,
    LoadWeightsRequest,
    OptimStepRequest,
    SaveWeightsForSamplerRequest,
    SaveWeightsRequest,
)

router = APIRouter(prefix="/api/v1")
_MAX_BODY = 256 * 1024 * 1024  # 256 MiB decompressed: far above the SDK's 5 MB chunks


def future_json(rec: FutureRecord, model_id: str | None = None) -> dict:
    out: dict = {"request_id": rec.request_id}
    if model_id is not None:
        out["model_id"] = model_id
    return out


def _touch(db, run: TrainingRunRow) -> None:
    run.last_request_time = utcnow()
    db.add(run)
    db.commit()


def _rejected(engine, run: TrainingRunRow, seq_id: int, message: str):
    """A coroutine factory that lets ``seq_id`` pass the model's ordering, then fails."""

    async def run_() -> tuple[str, object]:
        await engine.trainer(run.base_model, "skip", run.id, seq_id)
        raise UserInputError(message)

    return run_


@router.post("/create_model")
async def create_model(
    req: CreateModelRequest,
    who: PrincipalDep,
    db: DbDep,
    engine: EngineDep,
    futures: FuturesDep,
    config: ConfigDep,
) -> dict:
    session = owned_session(db, who, req.session_id)
    model_cfg = config.model(req.base_model)
    if model_cfg is None:
        raise InvalidRequestError(
            f"base_model: {req.base_model!r} is not served here; available: "
            f"{[m.name for m in config.models]}"
        )
    rank = req.lora_config.rank
    if rank & (rank - 1):
        raise InvalidRequestError(f"lora_config.rank must be a power of 2, got {rank}")
    if rank > model_cfg.max_lora_rank:
        raise InvalidRequestError(
            f"lora_config.rank {rank} exceeds max LoRA rank {model_cfg.max_lora_rank} "
            f"for model {req.base_model}"
        )
    opt_type = (req.optimizer_config or {}).get("type", "adamw")
    if opt_type != "adamw":
        raise InvalidRequestError(
            f"optimizer_config.type: only 'adamw' is supported, got {opt_type!r}"
        )
    model_id = f"{session.id}:train:{req.model_seq_id}"
    if (prev := futures.lookup_idempotent((model_id, 0))) is not None:
        return future_json(prev, model_id)
    if db.get(TrainingRunRow, model_id) is not None:
        raise InvalidRequestError(f"model_seq_id: model {model_id} already exists in this session")
    seed = req.lora_config.seed if req.lora_config.seed is not None else 0
    spec = LoraSpec(
        rank=rank,
        train_attn=req.lora_config.train_attn,
        train_mlp=req.lora_config.train_mlp,
        train_unembed=req.lora_config.train_unembed,
        seed=seed,
    )
    run = TrainingRunRow(
        id=model_id,
        session_id=session.id,
        user_id=who.user_id,
        base_model=req.base_model,
        lora_rank=rank,
        train_attn=spec.train_attn,
        train_mlp=spec.train_mlp,
        train_unembed=spec.train_unembed,
        seed=seed,
        user_metadata=req.user_metadata or {},
    )
    db.add(run)
    db.commit()

    async def run_() -> tuple[str, object]:
        await engine.trainer(req.base_model, "create_adapter", model_id, spec, str(who.user_id))
        return "json", {"model_id": model_id, "type": "create_model"}

    rec = futures.submit(
        user_id=who.user_id,
        extra={"base_model": run.base_model},
        kind="create_model",
        run=run_,
        idem_key=(model_id, 0),
    )
    return future_json(rec, model_id)


@router.post("/get_info")
async def get_info(req: GetInfoRequest, who: PrincipalDep, db: DbDep) -> dict:
    run = owned_run(db, who, req.model_id)
    return {
        "type": "get_info",
        "model_id": run.id,
        "model_data": {
            "arch": "lora",
            "model_name": run.base_model,
            "tokenizer_id": run.base_model,
        },
        "model_name": run.base_model,
        "is_lora": True,
        "lora_rank": run.lora_rank,
        "optimizer_config": {"type": "adamw"},
    }


async def _read_body(request: Request) -> bytes:
    body = await request.body()
    if request.headers.get("content-encoding", "").lower() == "zstd":
        try:
            body = zstandard.ZstdDecompressor().decompress(body, max_output_size=_MAX_BODY)
        except zstandard.ZstdError:
            raise InvalidRequestError("body: invalid zstd data") from None
    return body


@router.post("/forward_backward")
async def forward_backward(
    request: Request, who: PrincipalDep, db: DbDep, engine: EngineDep, futures: FuturesDep
) -> dict:
    ctype = request.headers.get("content-type", "")
    if "protobuf" not in ctype:
        raise InvalidRequestError(
            "content-type: forward_backward takes an application/x-protobuf ForwardBackwardRequest"
        )
    body = await _read_body(request)
    try:
        model_id, seq_id, inp = decode_forward_backward(body)
        error = None
    except InvalidRequestError as exc:
        # A structurally broken datum still carries model_id / seq_id: fail the future in order.
        from tinker.proto import tinker_public_pb2 as pb

        msg = pb.ForwardBackwardRequest()
        try:
            msg.ParseFromString(body)
        except Exception:
            raise exc from None
        if not msg.model_id or msg.seq_id < 1:
            raise
        model_id, seq_id, inp, error = msg.model_id, int(msg.seq_id), None, str(exc)
    if seq_id < 1:
        raise InvalidRequestError(f"seq_id: must be ≥ 1, got {seq_id}")
    run = owned_run(db, who, model_id)
    if (prev := futures.lookup_idempotent((model_id, seq_id))) is not None:
        return future_json(prev, model_id)
    _touch(db, run)
    kind = "forward" if inp is not None and inp.forward_only else "forward_backward"
    if error is not None:
        rec = futures.submit(
            user_id=who.user_id,
            extra={"base_model": run.base_model},
            kind=kind,
            idem_key=(model_id, seq_id),
            run=_rejected(engine, run, seq_id, error),
        )
        return future_json(rec, model_id)

    async def run_() -> tuple[str, object]:
        out = await engine.trainer(run.base_model, "forward_backward", model_id, seq_id, inp)
        return "proto", encode_forward_backward_output(out)

    rec = futures.submit(
        user_id=who.user_id,
        extra={"base_model": run.base_model},
        kind=kind,
        run=run_,
        idem_key=(model_id, seq_id),
    )
    return future_json(rec, model_id)


@router.post("/optim_step")
async def optim_step(
    req: OptimStepRequest, who: PrincipalDep, db: DbDep, engine: EngineDep, futures: FuturesDep
) -> dict:
    run = owned_run(db, who, req.model_id)
    if (prev := futures.lookup_idempotent((run.id, req.seq_id))) is not None:
        return future_json(prev, run.id)
    _touch(db, run)
    if req.adam_params is None and req.optimizer_params is not None:
        rec = futures.submit(
            user_id=who.user_id,
            extra={"base_model": run.base_model},
            kind="optim_step",
            idem_key=(run.id, req.seq_id),
            run=_rejected(
                engine, run, req.seq_id, "optimizer_params: only AdamW (adam_params) is supported"
            ),
        )
        return future_json(rec, run.id)
    params = AdamParams(**(req.adam_params.model_dump() if req.adam_params else {}))

    async def run_() -> tuple[str, object]:
        out = await engine.trainer(run.base_model, "optim_step", run.id, req.seq_id, params)
        return "json", {"metrics": out.metrics, "type": "optim_step"}

    rec = futures.submit(
        user_id=who.user_id,
        extra={"base_model": run.base_model},
        kind="optim_step",
        run=run_,
        idem_key=(run.id, req.seq_id),
    )
    return future_json(rec, run.id)


def _save_future(
    *,
    who,
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
) -> FutureRecord:
    """Save in seq order, then record the checkpoint row (replacing an overwritten one)."""
    parsed = ParsedPath(run.id, kind, name)
    existing = db.exec(
        select(CheckpointRow).where(CheckpointRow.tinker_path == parsed.tinker_path)
    ).first()
    if existing is not None and not overwrite and not ephemeral:
        return futures.submit(
            user_id=who.user_id,
            extra={"base_model": run.base_model},
            kind="save",
            idem_key=(run.id, seq_id),
            run=_rejected(
                engine,
                run,
                seq_id,
                f"path: checkpoint {parsed.tinker_path} already exists; "
                "pass overwrite=True to replace it",
            ),
        )
    directory = new_storage_dir(settings.data_dir, who.user_id, parsed)
    directory.parent.mkdir(parents=True, exist_ok=True)
    expires = None
    if ttl_seconds is not None:
        from datetime import timedelta

        expires = utcnow() + timedelta(seconds=ttl_seconds)

    async def run_() -> tuple[str, object]:
        size = await engine.trainer(
            run.base_model, "save_state", run.id, seq_id, str(directory), include_optimizer
        )
        from sqlmodel import Session

        with Session(db.get_bind()) as s:
            old = s.exec(
                select(CheckpointRow).where(CheckpointRow.tinker_path == parsed.tinker_path)
            ).first()
            if old is not None:
                import shutil

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
        rtype = "save_weights" if kind == "training" else "save_weights_for_sampler"
        return "json", {"path": parsed.tinker_path, "type": rtype}

    return futures.submit(
        user_id=who.user_id,
        extra={"base_model": run.base_model},
        kind="save",
        run=run_,
        idem_key=(run.id, seq_id),
    )


@router.post("/save_weights")
async def save_weights(
    req: SaveWeightsRequest,
    who: PrincipalDep,
    db: DbDep,
    engine: EngineDep,
    futures: FuturesDep,
    settings: SettingsDep,
) -> dict:
    run = owned_run(db, who, req.model_id)
    if (prev := futures.lookup_idempotent((run.id, req.seq_id))) is not None:
        return future_json(prev, run.id)
    _touch(db, run)
    try:
        name = validate_name(req.path or "", "path")
    except InvalidRequestError as exc:
        rec = futures.submit(
            user_id=who.user_id,
            extra={"base_model": run.base_model},
            kind="save",
            idem_key=(run.id, req.seq_id),
            run=_rejected(engine, run, req.seq_id, str(exc)),
        )
        return future_json(rec, run.id)
    rec = _save_future(
        who=who,
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
) -> dict:
    run = owned_run(db, who, req.model_id)
    if (prev := futures.lookup_idempotent((run.id, req.seq_id))) is not None:
        return future_json(prev, run.id)
    _touch(db, run)
    common = dict(
        who=who,
        db=db,
        engine=engine,
        futures=futures,
        settings=settings,
        run=run,
        seq_id=req.seq_id,
        kind="sampler",
        include_optimizer=False,
        user_metadata=req.user_metadata,
    )
    if req.path is None:
        if req.sampling_session_seq_id is None:
            rec = futures.submit(
                user_id=who.user_id,
                extra={"base_model": run.base_model},
                kind="save",
                idem_key=(run.id, req.seq_id),
                run=_rejected(
                    engine,
                    run,
                    req.seq_id,
                    "path: give a name, or sampling_session_seq_id for an ephemeral save",
                ),
            )
            return future_json(rec, run.id)
        sampler_id = f"{run.session_id}:sample:{req.sampling_session_seq_id}"
        # Ephemeral weights expire with a day's margin; they exist only to back that sampler.
        rec = _save_future(
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
        rec = futures.submit(
            user_id=who.user_id,
            extra={"base_model": run.base_model},
            kind="save",
            idem_key=(run.id, req.seq_id),
            run=_rejected(engine, run, req.seq_id, str(exc)),
        )
        return future_json(rec, run.id)
    rec = _save_future(**common, name=name, overwrite=True, ttl_seconds=req.ttl_seconds)
    return future_json(rec, run.id)


@router.post("/load_weights")
async def load_weights(
    req: LoadWeightsRequest,
    who: PrincipalDep,
    db: DbDep,
    engine: EngineDep,
    futures: FuturesDep,
    config: ConfigDep,
) -> dict:
    ckpt = readable_checkpoint(db, who.user_id, req.path, "path")
    if ckpt.kind != "training":
        raise InvalidRequestError(
            f"path: {req.path} is a {ckpt.kind} checkpoint; load_weights needs a weights/ "
            "checkpoint saved with save_state"
        )
    source = db.get(TrainingRunRow, ckpt.run_id)
    if source is None:
        raise NotFoundError(f"path: training run of {req.path} not found")
    directory = ckpt.storage_dir
    if req.model_id is not None:  # legacy in-place load_state, sequenced
        run = owned_run(db, who, req.model_id)
        seq_id = req.seq_id or 0
        if (prev := futures.lookup_idempotent((run.id, seq_id))) is not None:
            return future_json(prev, run.id)

        async def run_in_place() -> tuple[str, object]:
            await engine.trainer(
                run.base_model, "load_state", run.id, seq_id, directory, req.optimizer
            )
            return "json", {"path": req.path, "model_id": run.id, "type": "load_weights"}

        rec = futures.submit(
            user_id=who.user_id,
            extra={"base_model": run.base_model},
            kind="load_weights",
            run=run_in_place,
            idem_key=(run.id, seq_id),
        )
        return future_json(rec, run.id)
    if req.session_id is None or req.model_seq_id is None:
        raise InvalidRequestError(
            "session_id, model_seq_id: required to create a model from a checkpoint"
        )
    session = owned_session(db, who, req.session_id)
    if req.base_model is not None and req.base_model != source.base_model:
        raise InvalidRequestError(
            f"base_model: checkpoint was trained on {source.base_model}, not {req.base_model}"
        )
    if config.model(source.base_model) is None:
        raise InvalidRequestError(f"path: base model {source.base_model} is no longer served")
    model_id = f"{session.id}:train:{req.model_seq_id}"
    if (prev := futures.lookup_idempotent((model_id, 0))) is not None:
        return future_json(prev, model_id)
    if db.get(TrainingRunRow, model_id) is not None:
        raise InvalidRequestError(f"model_seq_id: model {model_id} already exists in this session")
    run = TrainingRunRow(
        id=model_id,
        session_id=session.id,
        user_id=who.user_id,
        base_model=source.base_model,
        lora_rank=source.lora_rank,
        train_attn=source.train_attn,
        train_mlp=source.train_mlp,
        train_unembed=source.train_unembed,
        seed=source.seed,
        user_metadata=req.user_metadata or {},
    )
    db.add(run)
    db.commit()

    async def run_create() -> tuple[str, object]:
        await engine.trainer(
            run.base_model, "load_state", model_id, None, directory, req.optimizer, str(who.user_id)
        )
        return "json", {"path": req.path, "model_id": model_id, "type": "load_weights"}

    rec = futures.submit(
        user_id=who.user_id,
        extra={"base_model": run.base_model},
        kind="load_weights",
        run=run_create,
        idem_key=(model_id, 0),
    )
    return future_json(rec, model_id)
