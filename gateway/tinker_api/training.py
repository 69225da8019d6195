"""Tinker training endpoints: create_model, get_info, forward_backward (and 0.16.x's forward),
optim_step, load_weights. Saves are in `saves.py`, exports in `exports.py`.

Every sequenced request becomes a future that passes through the Trainer's seq_id ordering, even
when it is rejected (a rejected seq_id must still advance the model's sequence, or every later
request would wait for it).
"""

from __future__ import annotations

import json

import zstandard
from fastapi import APIRouter, Request

from engine.protocol import AdamParams, LoraSpec
from gateway.accounts.usage import UsageLedger
from gateway.db.tables import TrainingRunRow, utcnow
from gateway.deps import (
    ConfigDep,
    DbDep,
    EngineDep,
    FuturesDep,
    PrincipalDep,
    owned_run,
    owned_session,
)
from gateway.errors import InvalidRequestError, NotFoundError, QuotaExceededError
from gateway.futures.store import FutureRecord, fingerprint
from gateway.quotas import QuotasDep
from gateway.runs.checkpoints import readable_checkpoint
from gateway.tinker_api import compat, jobs
from gateway.tinker_api.proto_codec import decode_forward_backward
from gateway.tinker_api.schemas import (
    CreateModelRequest,
    GetInfoRequest,
    LoadWeightsRequest,
    OptimStepRequest,
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
    return jobs.runner(engine, jobs.skip_job(run.base_model, run.id, seq_id, message))


def reject_in_order(
    futures, engine, who, run: TrainingRunRow, seq_id: int, message: str, *, kind: str, fp
) -> FutureRecord:
    """A future for a request the gateway refused: it fails with ``message`` (a user error)
    once ``seq_id``'s turn has passed, so later requests of the model are not held up."""
    return futures.submit(
        user_id=who.user_id,
        extra={"base_model": run.base_model},
        kind=kind,
        idem_key=(run.id, seq_id),
        fp=fp,
        run=_rejected(engine, run, seq_id, message),
    )


@router.post("/create_model")
async def create_model(
    req: CreateModelRequest,
    who: PrincipalDep,
    db: DbDep,
    engine: EngineDep,
    futures: FuturesDep,
    config: ConfigDep,
    quotas: QuotasDep,
) -> dict:
    fp = fingerprint(req.model_dump(mode="json"))
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
    if (prev := await futures.lookup_idempotent((model_id, 0), fp)) is not None:
        return future_json(prev, model_id)
    if db.get(TrainingRunRow, model_id) is not None:
        raise InvalidRequestError(f"model_seq_id: model {model_id} already exists in this session")
    limits = quotas.limits(who, db)
    quotas.check_lora_rank(who, rank, limits)
    await quotas.acquire_training_client(who, model_id, limits, db)  # 403 at the cap, atomically
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

    run_ = jobs.runner(
        engine, jobs.create_adapter_job(req.base_model, model_id, spec, str(who.user_id))
    )

    rec = futures.submit(
        user_id=who.user_id,
        extra={"base_model": run.base_model},
        kind="create_model",
        run=run_,
        idem_key=(model_id, 0),
        fp=fp,
    )
    return future_json(rec, model_id)


@router.post("/get_info")
async def get_info(req: GetInfoRequest, who: PrincipalDep, db: DbDep) -> dict:
    run = owned_run(db, who, req.model_id, live=True)
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


@router.post("/forward")  # SDK 0.16.x: forward-only, JSON body
@router.post("/forward_backward")
async def forward_backward(
    request: Request,
    who: PrincipalDep,
    db: DbDep,
    engine: EngineDep,
    futures: FuturesDep,
    quotas: QuotasDep,
) -> dict:
    ctype = request.headers.get("content-type", "")
    if "json" in ctype:  # the JSON wire format of older SDKs
        try:
            payload = json.loads(await _read_body(request))
        except ValueError:
            raise InvalidRequestError("body: invalid JSON") from None
        body = compat.json_forward_backward_to_proto(
            payload, forward_only=request.url.path.endswith("/forward")
        )
    elif "protobuf" in ctype:
        body = await _read_body(request)
    else:
        raise InvalidRequestError(
            "content-type: forward_backward takes an application/x-protobuf "
            "ForwardBackwardRequest (or the JSON of older SDKs)"
        )
    fp = fingerprint(body)
    try:
        model_id, seq_id, inp = decode_forward_backward(body)
        error = None
    except InvalidRequestError as exc:
        # A structurally broken datum still carries model_id / seq_id: fail the future in order.
        from gateway.tinker_api.wire_pb import pb

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
    run = owned_run(db, who, model_id, live=True)
    if (prev := await futures.lookup_idempotent((model_id, seq_id), fp)) is not None:
        return future_json(prev, model_id)
    _touch(db, run)
    kind = "forward" if inp is not None and inp.forward_only else "forward_backward"
    if error is not None:
        rec = reject_in_order(futures, engine, who, run, seq_id, error, kind=kind, fp=fp)
        return future_json(rec, model_id)

    n_tokens = sum(len(d.tokens) for d in inp.data)
    try:  # over the rate: 429 + retry-after (the SDK resends this seq_id)
        await quotas.charge_tokens(who, "train", n_tokens, quotas.limits(who, db))
    except QuotaExceededError as exc:  # can never fit: fail this seq_id in order
        rec = reject_in_order(futures, engine, who, run, seq_id, str(exc), kind=kind, fp=fp)
        return future_json(rec, model_id)
    ledger: UsageLedger = request.app.state.usage
    job_run = jobs.runner(engine, jobs.forward_backward_job(run.base_model, model_id, seq_id, body))

    async def run_() -> tuple[str, object]:
        out = await job_run()
        ledger.record(
            user_id=who.user_id,
            org_id=who.org_id,
            kind="training",
            quantity=n_tokens,
            session_id=run.session_id,
            base_model=run.base_model,
        )
        return out

    run_.job = job_run.job  # type: ignore[attr-defined]  # a replica taking over re-runs it

    rec = futures.submit(
        user_id=who.user_id,
        extra={"base_model": run.base_model},
        kind=kind,
        run=run_,
        idem_key=(model_id, seq_id),
        fp=fp,
    )
    return future_json(rec, model_id)


@router.post("/optim_step")
async def optim_step(
    req: OptimStepRequest, who: PrincipalDep, db: DbDep, engine: EngineDep, futures: FuturesDep
) -> dict:
    fp = fingerprint(req.model_dump(mode="json"))
    run = owned_run(db, who, req.model_id, live=True)
    if (prev := await futures.lookup_idempotent((run.id, req.seq_id), fp)) is not None:
        return future_json(prev, run.id)
    _touch(db, run)
    if req.adam_params is None and req.optimizer_params is not None:
        rec = reject_in_order(
            futures,
            engine,
            who,
            run,
            req.seq_id,
            "optimizer_params: only AdamW (adam_params) is supported",
            kind="optim_step",
            fp=fp,
        )
        return future_json(rec, run.id)
    params = AdamParams(**(req.adam_params.model_dump() if req.adam_params else {}))

    run_ = jobs.runner(engine, jobs.optim_step_job(run.base_model, run.id, req.seq_id, params))

    rec = futures.submit(
        user_id=who.user_id,
        extra={"base_model": run.base_model},
        kind="optim_step",
        run=run_,
        idem_key=(run.id, req.seq_id),
        fp=fp,
    )
    return future_json(rec, run.id)


@router.post("/load_weights")
async def load_weights(
    req: LoadWeightsRequest,
    who: PrincipalDep,
    db: DbDep,
    engine: EngineDep,
    futures: FuturesDep,
    config: ConfigDep,
    quotas: QuotasDep,
) -> dict:
    fp = fingerprint(req.model_dump(mode="json"))
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
        run = owned_run(db, who, req.model_id, live=True)
        seq_id = req.seq_id or 0
        if (prev := await futures.lookup_idempotent((run.id, seq_id), fp)) is not None:
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
            fp=fp,
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
    if (prev := await futures.lookup_idempotent((model_id, 0), fp)) is not None:
        return future_json(prev, model_id)
    if db.get(TrainingRunRow, model_id) is not None:
        raise InvalidRequestError(f"model_seq_id: model {model_id} already exists in this session")
    limits = quotas.limits(who, db)
    quotas.check_lora_rank(who, source.lora_rank, limits)
    await quotas.acquire_training_client(who, model_id, limits, db)
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
        fp=fp,
    )
    return future_json(rec, model_id)
