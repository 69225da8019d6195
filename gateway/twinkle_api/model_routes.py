"""Native model routes: ``POST /api/v1/twinkle/model/create`` and ``/model/{method}``.

One route per method of the engine's `MultiLoraTransformersModel` (the whitelist below), with the
arguments in ``kwargs`` checked against that method's signature: a remote call behaves exactly as
the in-process call, including its errors (400 naming the argument or rule). What differs is
where checkpoints live: names and ``twinkle://`` paths instead of server directories
(``output_dir`` is refused), recorded as the caller's checkpoints of the adapter's training run,
so the Tinker RestClient and the native management calls list and delete them alike.
"""

from __future__ import annotations

import asyncio
import inspect
import shutil
from typing import Any

import numpy as np
from fastapi import APIRouter, Request
from sqlmodel import Session, select

from engine.local.training_config import lora_spec_from_config
from engine.protocol import LoraSpec
from gateway.db.tables import CheckpointRow, TrainingRunRow, utcnow
from gateway.deps import ConfigDep, DbDep, EngineDep, PrincipalDep, SettingsDep, owned_session
from gateway.errors import InvalidRequestError, NotFoundError
from gateway.runs.checkpoints import ParsedPath, new_storage_dir, readable_checkpoint, validate_name
from gateway.twinkle_api.model_registry import NativeModel, make_native_model, native_models
from gateway.twinkle_api.schemas import CloseModelRequest, CreateModelRequest, ModelCallRequest
from gateway.twinkle_api.templates import check_processor, check_template

router = APIRouter(prefix="/api/v1/twinkle")

#: methods forwarded as they are (the engine class validates their arguments)
PLAIN_METHODS = frozenset(
    {
        "set_loss",
        "set_optimizer",
        "set_lr_scheduler",
        "forward",
        "forward_only",
        "forward_backward",
        "calculate_loss",
        "backward",
        "clip_grad_norm",
        "step",
        "zero_grad",
        "lr_step",
        "clip_grad_and_step",
        "calculate_metric",
        "get_train_configs",
        "remove_adapter",
    }
)
SPECIAL_METHODS = frozenset(
    {
        "add_adapter_to_model",
        "set_template",
        "set_processor",
        "save",
        "load",
        "resume_from_checkpoint",
    }
)


def jsonable(value: Any) -> Any:
    """numpy arrays / scalars and tuples as plain JSON values."""
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    return value


def twinkle_path(tinker_path: str) -> str:
    return "twinkle://" + tinker_path.removeprefix("tinker://")


async def _invoke(nm: NativeModel, method: str, adapter_name: str, kwargs: dict) -> Any:
    fn = getattr(nm.model, method)
    try:
        inspect.signature(fn).bind(adapter_name=adapter_name, **kwargs)
    except TypeError as exc:
        raise InvalidRequestError(f"kwargs: {method}() {exc}") from None
    return await asyncio.to_thread(lambda: fn(adapter_name=adapter_name, **kwargs))


@router.post("/model/create")
async def create_model(
    req: CreateModelRequest,
    request: Request,
    who: PrincipalDep,
    db: DbDep,
    engine: EngineDep,
    config: ConfigDep,
    settings: SettingsDep,
) -> dict:
    session = owned_session(db, who, req.session_id)
    if config.model(req.base_model) is None:
        raise InvalidRequestError(
            f"base_model: {req.base_model!r} is not served here; available: "
            f"{[m.name for m in config.models]}"
        )
    info = await engine.trainer(req.base_model, "info")
    reg = native_models(request)
    model_id = reg.new_id(session.id)
    model, proxy = make_native_model(
        engine=engine,
        loop=asyncio.get_running_loop(),
        model_id=model_id,
        base_model=req.base_model,
        tenant=str(who.user_id),
        info=info,
        data_dir=settings.data_dir,
    )
    reg.add(NativeModel(model_id, who.user_id, session.id, req.base_model, model, proxy))
    return {
        "model_id": model_id,
        "base_model": req.base_model,
        "max_lora_rank": info["max_lora_rank"],
    }


@router.post("/model/close")
async def close_model(req: CloseModelRequest, request: Request, who: PrincipalDep) -> dict:
    """Drop the model's adapters from the Trainer and forget the model (runs and checkpoints
    stay). Idempotent for the owner."""
    reg = native_models(request)
    nm = reg.owned(req.model_id, who.user_id)
    async with nm.lock:
        for name in list(nm.model.adapter_names):
            await asyncio.to_thread(nm.model.remove_adapter, name)
        reg.drop(nm.model_id)
    return {"closed": nm.model_id}


@router.post("/model/{method}")
async def call_model(
    method: str,
    req: ModelCallRequest,
    request: Request,
    who: PrincipalDep,
    db: DbDep,
    settings: SettingsDep,
) -> dict:
    if method not in PLAIN_METHODS and method not in SPECIAL_METHODS:
        raise NotFoundError(
            f"method: {method!r} is not a model method; available: "
            f"{', '.join(sorted(PLAIN_METHODS | SPECIAL_METHODS))}"
        )
    nm = native_models(request).owned(req.model_id, who.user_id)
    kw, name = dict(req.kwargs), req.adapter_name
    async with nm.lock:  # the model class is driven by one thread at a time
        if method in PLAIN_METHODS:
            result = await _invoke(nm, method, name, kw)
        elif method == "set_template":
            check_template(kw.get("template"), {k: v for k, v in kw.items() if k != "template"})
            result = await _invoke(nm, method, name, kw)
        elif method == "set_processor":
            check_processor(kw.get("processor"), {k: v for k, v in kw.items() if k != "processor"})
            result = await _invoke(nm, method, name, kw)
        elif method == "add_adapter_to_model":
            result = await _add_adapter(nm, name, kw, who, db, request.app.state.quotas)
        elif method == "save":
            result = await _save(nm, name, kw, who, db, settings)
        else:  # load, resume_from_checkpoint
            result = await _load(nm, method, name, kw, who, db)
    return {"result": jsonable(result)}


def _no_server_paths(kw: dict) -> None:
    if kw.pop("output_dir", None) is not None:
        raise InvalidRequestError(
            "output_dir: server directories are not accepted; use a checkpoint name or a "
            "twinkle:// path"
        )


def _checkpoint(db, who, nm: NativeModel, adapter_name: str, ref: Any, field: str) -> CheckpointRow:
    if not isinstance(ref, str) or not ref:
        raise InvalidRequestError(f"{field}: must be a checkpoint name or a twinkle:// path")
    if "://" not in ref:
        validate_name(ref, field)
        ref = ParsedPath(nm.proxy.run_id(adapter_name), "training", ref).tinker_path
    ckpt = readable_checkpoint(db, who.user_id, ref, field)
    src = db.get(TrainingRunRow, ckpt.run_id)
    if src is None or src.base_model != nm.base_model:
        base = src.base_model if src else "?"
        raise InvalidRequestError(
            f"{field}: checkpoint was trained on {base}, this model is {nm.base_model}"
        )
    return ckpt


def _spec_of(run: TrainingRunRow) -> LoraSpec:
    return LoraSpec(
        rank=run.lora_rank,
        train_attn=run.train_attn,
        train_mlp=run.train_mlp,
        train_unembed=run.train_unembed,
        seed=run.seed,
    )


def _ensure_run_row(db, who, nm: NativeModel, adapter_name: str, spec) -> TrainingRunRow:
    rid = nm.proxy.run_id(adapter_name)
    row = db.get(TrainingRunRow, rid)
    if row is None:
        row = TrainingRunRow(
            id=rid,
            session_id=nm.session_id,
            user_id=who.user_id,
            base_model=nm.base_model,
            lora_rank=spec.rank,
            train_attn=spec.train_attn,
            train_mlp=spec.train_mlp,
            train_unembed=spec.train_unembed,
            seed=spec.seed,
            user_metadata={"client": "twinkle", "adapter_name": adapter_name},
        )
        db.add(row)
        db.commit()
    return row


async def _add_adapter(nm: NativeModel, name: str, kw: dict, who, db, quotas) -> None:
    if "config" not in kw:
        raise InvalidRequestError(
            "kwargs.config: a LoRA config (dict) or a checkpoint path is required"
        )
    if nm.proxy.has_adapter(name):
        raise InvalidRequestError(f"adapter_name: {name!r} exists already in this model")
    config = kw["config"]
    if isinstance(config, str):  # start from a checkpoint's weights
        ckpt = _checkpoint(db, who, nm, name, config, "config")
        src = db.get(TrainingRunRow, ckpt.run_id)
        spec = _spec_of(src)
        kw["config"] = ckpt.storage_dir
    elif isinstance(config, dict):
        spec = lora_spec_from_config(config)
        if spec.rank > nm.proxy.max_lora_rank:
            raise InvalidRequestError(
                f"config.r: rank {spec.rank} exceeds max LoRA rank {nm.proxy.max_lora_rank} "
                f"for model {nm.base_model}"
            )
    else:
        raise InvalidRequestError("kwargs.config: must be a LoRA config dict or a checkpoint path")
    # the same quotas as Tinker's create_model: max LoRA rank, concurrent training clients
    limits = quotas.limits(who, db)
    quotas.check_lora_rank(who, spec.rank, limits)
    await quotas.acquire_training_client(who, nm.proxy.run_id(name), limits, db)
    existed = db.get(TrainingRunRow, nm.proxy.run_id(name)) is not None
    row = _ensure_run_row(db, who, nm, name, spec)
    if existed:  # re-added after remove_adapter: the run (and its checkpoints) continue
        row.lora_rank, row.seed = spec.rank, spec.seed
        row.train_attn, row.train_mlp = spec.train_attn, spec.train_mlp
        row.train_unembed = spec.train_unembed
        db.add(row)
        db.commit()
    try:
        await _invoke(nm, "add_adapter_to_model", name, kw)
    except BaseException:
        if not existed:
            db.delete(row)
            db.commit()
            await quotas.release_training_clients(who.user_id, who.org_id, [row.id])
        raise


async def _save(nm: NativeModel, name: str, kw: dict, who, db, settings) -> dict:
    _no_server_paths(kw)
    ckpt_name = validate_name(kw.get("name") or "", "name")
    rid = nm.proxy.run_id(name)
    if not nm.proxy.has_adapter(name) or db.get(TrainingRunRow, rid) is None:
        raise NotFoundError(f"adapter_name: adapter {name!r} is not in this model")
    kind = "sampler" if kw.get("is_sampler") else "training"
    parsed = ParsedPath(rid, kind, ckpt_name)
    directory = new_storage_dir(settings.data_dir, who.user_id, parsed)
    directory.parent.mkdir(parents=True, exist_ok=True)
    kw.update(name=directory.name, output_dir=directory.parent)
    await _invoke(nm, "save", name, kw)
    size = sum(f.stat().st_size for f in directory.rglob("*") if f.is_file())
    with Session(db.get_bind()) as s:
        old = s.exec(select(CheckpointRow).where(CheckpointRow.tinker_path == parsed.tinker_path))
        old = old.first()
        if old is not None:  # same name again: the new checkpoint replaces it (as upstream)
            shutil.rmtree(old.storage_dir, ignore_errors=True)
            s.delete(old)
            s.flush()
        meta = {}
        if kw.get("consumed_train_samples") is not None:
            meta["consumed_train_samples"] = kw["consumed_train_samples"]
        s.add(
            CheckpointRow(
                run_id=rid,
                user_id=who.user_id,
                kind=kind,
                name=ckpt_name,
                tinker_path=parsed.tinker_path,
                storage_dir=str(directory),
                size_bytes=size,
                user_metadata=meta,
                created_at=utcnow(),
            )
        )
        s.commit()
    return {
        "twinkle_path": twinkle_path(parsed.tinker_path),
        "checkpoint_id": parsed.checkpoint_id,
        "size_bytes": size,
    }


async def _load(nm: NativeModel, method: str, name: str, kw: dict, who, db) -> Any:
    _no_server_paths(kw)
    ref = kw.get("name")
    ckpt = _checkpoint(db, who, nm, name, ref, "name")
    src = db.get(TrainingRunRow, ckpt.run_id)
    _ensure_run_row(db, who, nm, name, _spec_of(src))
    kw["name"] = ckpt.storage_dir
    result = await _invoke(nm, method, name, kw)
    path = twinkle_path(ckpt.tinker_path)
    if isinstance(result, dict):
        return {**result, "checkpoint": path}
    return path
