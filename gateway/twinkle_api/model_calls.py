"""What the gateway adds to a native model call before the engine runs it: the calls that need
the DB, quotas or checkpoint storage (model_routes.py routes every call here or to the engine).

A native model is the engine's `MultiLoraTransformersModel`, hosted by the Trainer replica that
holds its adapters (engine/native/host.py). The engine checks the call's kwargs against the
method's own signature, so a remote call behaves exactly as the in-process call, including its
errors (400 naming the argument or rule). What the gateway adds is what needs the DB and
quotas: each adapter is a training run of the caller's (created on add_adapter_to_model, under
the Tinker create_model quotas), and checkpoints are names and ``twinkle://`` paths instead of
server directories (``output_dir`` is refused), recorded as the caller's checkpoints of the
adapter's run, so the Tinker RestClient and the native management calls list and delete them
alike.
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
from sqlmodel import Session, col, select

from engine.protocol import LoraSpec
from engine.rules import lora_spec_from_config
from gateway.accounts.keys import Principal
from gateway.db.tables import CheckpointRow, TrainingRunRow, utcnow
from gateway.engine_client import EngineClient
from gateway.errors import InvalidRequestError, NotFoundError
from gateway.runs.checkpoints import ParsedPath, new_storage_dir, readable_checkpoint, validate_name
from gateway.settings import Settings
from gateway.twinkle_api.model_registry import NativeModel
from gateway.twinkle_api.templates import check_processor, check_template


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


@dataclass
class Call:
    """One ``model/{method}`` call: the owned model and what the special methods need."""

    nm: NativeModel
    adapter: str
    who: Principal
    db: Session
    engine: EngineClient
    settings: Settings
    quotas: Any
    usage: Any = None

    async def invoke(self, method: str, kwargs: dict) -> Any:
        nm = self.nm
        return await self.engine.trainer(nm.base_model).native_call(
            nm.model_id, tenant=nm.tenant, method=method, adapter_name=self.adapter, kwargs=kwargs
        )

    async def has_adapter(self) -> bool:
        nm = self.nm
        names = await self.engine.trainer(nm.base_model).native_adapters(
            nm.model_id, tenant=nm.tenant
        )
        return self.adapter in names


def count_tokens(inputs: Any) -> int:
    """Tokens of a pass's inputs as the client sent them (rows with ``input_ids``, a batched
    dict, or Tinker-style ``model_input``); what the engine rejects counts 0, it runs nothing."""
    rows = inputs if isinstance(inputs, list) else [inputs]
    total = 0
    for row in rows:
        ids = row.get("input_ids", row.get("model_input")) if isinstance(row, dict) else None
        if isinstance(ids, list):
            nested = bool(ids) and isinstance(ids[0], list)
            total += sum(len(r) for r in ids if isinstance(r, list)) if nested else len(ids)
    return total


def _metered(method: str) -> Callable[[Call, dict], Awaitable[Any]]:
    """A pass under the Tinker routes' training-token rate (429 + retry-after over it) and
    recorded in the usage ledger once it ran."""

    async def run(call: Call, kw: dict) -> Any:
        who, n = call.who, count_tokens(kw.get("inputs"))
        await call.quotas.charge_tokens(who, "train", n, call.quotas.limits(who, call.db))
        result = await call.invoke(method, kw)
        if call.usage is not None:
            call.usage.record(
                user_id=who.user_id,
                org_id=who.org_id,
                kind="training",
                quantity=n,
                session_id=call.nm.session_id,
                base_model=call.nm.base_model,
            )
        return result

    return run


async def _set_template(call: Call, kw: dict) -> Any:
    kw.pop("model_id", None)  # upstream's client adds its model id; the model is the URL's
    check_template(kw.get("template"), {k: v for k, v in kw.items() if k != "template"})
    return await call.invoke("set_template", kw)


async def _set_processor(call: Call, kw: dict) -> Any:
    check_processor(kw.get("processor"), {k: v for k, v in kw.items() if k != "processor"})
    return await call.invoke("set_processor", kw)


def _no_server_paths(kw: dict) -> None:
    if kw.pop("output_dir", None) is not None:
        raise InvalidRequestError(
            "output_dir: server directories are not accepted; use a checkpoint name or a "
            "twinkle:// path"
        )


def _checkpoint(call: Call, ref: Any, field: str) -> tuple[CheckpointRow, TrainingRunRow]:
    """The caller's checkpoint by name (of this adapter's run) or path, trained on this model,
    and the run it belongs to."""
    if not isinstance(ref, str) or not ref:
        raise InvalidRequestError(f"{field}: must be a checkpoint name or a twinkle:// path")
    if "://" not in ref:
        validate_name(ref, field)
        ref = ParsedPath(call.nm.run_id(call.adapter), "training", ref).tinker_path
    ckpt = readable_checkpoint(call.db, call.who.user_id, ref, field)
    src = call.db.get(TrainingRunRow, ckpt.run_id)
    if src is None or src.base_model != call.nm.base_model:
        base = src.base_model if src else "?"
        raise InvalidRequestError(
            f"{field}: checkpoint was trained on {base}, this model is {call.nm.base_model}"
        )
    return ckpt, src


def _spec_of(run: TrainingRunRow) -> LoraSpec:
    return LoraSpec(
        rank=run.lora_rank,
        train_attn=run.train_attn,
        train_mlp=run.train_mlp,
        train_unembed=run.train_unembed,
        train_vision=run.train_vision,
        seed=run.seed,
    )


def _ensure_run_row(call: Call, spec: LoraSpec) -> TrainingRunRow:
    db, rid = call.db, call.nm.run_id(call.adapter)
    row = db.get(TrainingRunRow, rid)
    if row is None:
        row = TrainingRunRow(
            id=rid,
            session_id=call.nm.session_id,
            user_id=call.who.user_id,
            base_model=call.nm.base_model,
            lora_rank=spec.rank,
            train_attn=spec.train_attn,
            train_mlp=spec.train_mlp,
            train_unembed=spec.train_unembed,
            train_vision=spec.train_vision,
            seed=spec.seed,
            user_metadata={"client": "twinkle", "adapter_name": call.adapter},
        )
        db.add(row)
        db.commit()
    return row


def _lora_config(config: Any) -> Any:
    """Upstream's client sends the peft ``LoraConfig`` as a JSON string of its fields (plus its
    ``_TWINKLE_TYPE_`` tag); a string that is not JSON is a checkpoint path (our extension)."""
    if isinstance(config, str) and config.lstrip().startswith("{"):
        try:
            config = json.loads(config)
        except json.JSONDecodeError as exc:
            raise InvalidRequestError(f"config: not a valid JSON LoRA config ({exc})") from None
    if isinstance(config, dict):
        config = {k: v for k, v in config.items() if not k.startswith("_")}
    return config


async def _add_adapter(call: Call, kw: dict) -> None:
    nm, name, db, who, quotas = call.nm, call.adapter, call.db, call.who, call.quotas
    if kw.get("config") is None:
        raise InvalidRequestError(
            "config: a LoRA config is required (full-parameter training is not offered: the "
            "base model is shared by every tenant)"
        )
    # upstream's client sends its own machine's directory; checkpoints live in the server's
    # managed storage under twinkle:// names instead (model.save returns the path)
    kw.pop("save_dir", None)
    if await call.has_adapter():
        raise InvalidRequestError(f"adapter_name: {name!r} exists already in this model")
    config = kw["config"] = _lora_config(kw["config"])
    if isinstance(config, str):  # start from a checkpoint's weights
        ckpt, src = _checkpoint(call, config, "config")
        spec = _spec_of(src)
        kw["config"] = ckpt.storage_dir
    elif isinstance(config, dict):
        spec = lora_spec_from_config(config)
        if spec.rank > nm.max_lora_rank:
            raise InvalidRequestError(
                f"config.r: rank {spec.rank} exceeds max LoRA rank {nm.max_lora_rank} "
                f"for model {nm.base_model}"
            )
    else:
        raise InvalidRequestError("config: must be a LoRA config or a checkpoint path")
    # the same quotas as Tinker's create_model: max LoRA rank, concurrent training clients
    limits = quotas.limits(who, db)
    quotas.check_lora_rank(who, spec.rank, limits)
    await quotas.acquire_training_client(who, nm.run_id(name), limits, db)
    existed = db.get(TrainingRunRow, nm.run_id(name)) is not None
    row = _ensure_run_row(call, spec)
    if existed:  # re-added after remove_adapter: the run (and its checkpoints) continue
        row.lora_rank, row.seed = spec.rank, spec.seed
        row.train_attn, row.train_mlp = spec.train_attn, spec.train_mlp
        row.train_unembed, row.train_vision = spec.train_unembed, spec.train_vision
        db.add(row)
        db.commit()
    try:
        await call.invoke("add_adapter_to_model", kw)
    except BaseException:
        if not existed:
            db.delete(row)
            db.commit()
            await quotas.release_training_clients(who.user_id, who.org_id, [row.id])
        raise


async def _save(call: Call, kw: dict) -> dict:
    _no_server_paths(kw)
    kw.pop("save_dir", None)  # a client-machine directory (upstream): storage is the server's
    # upstream's name is optional; unnamed checkpoints get the time, as its server does
    ckpt_name = validate_name(kw.get("name") or time.strftime("%Y%m%d_%H%M%S"), "name")
    rid = call.nm.run_id(call.adapter)
    if call.db.get(TrainingRunRow, rid) is None or not await call.has_adapter():
        raise NotFoundError(f"adapter_name: adapter {call.adapter!r} is not in this model")
    kind = "sampler" if kw.get("is_sampler") else "training"
    parsed = ParsedPath(rid, kind, ckpt_name)
    directory = new_storage_dir(call.settings.data_dir, call.who.user_id, parsed)
    directory.parent.mkdir(parents=True, exist_ok=True)
    kw.update(name=directory.name, output_dir=str(directory.parent))
    # the checkpoint quotas (max_checkpoints, max_checkpoint_bytes), as for Tinker's saves: 403
    # at a cap before any work; the run's last checkpoint size estimates this one's
    last = call.db.exec(
        select(CheckpointRow.size_bytes)
        .where(CheckpointRow.run_id == rid)
        .order_by(col(CheckpointRow.created_at).desc())
    ).first()
    await call.quotas.reserve_checkpoint(call.who, parsed.tinker_path, int(last or 0), call.db)
    replaces = (
        call.db.exec(
            select(CheckpointRow.id).where(CheckpointRow.tinker_path == parsed.tinker_path)
        ).first()
        is not None
    )
    try:
        await call.invoke("save", kw)
    except BaseException:
        if not replaces:
            who = call.who
            await call.quotas.release_checkpoint(who.user_id, who.org_id, parsed.tinker_path)
        raise
    size = sum(f.stat().st_size for f in directory.rglob("*") if f.is_file())
    await call.quotas.commit_checkpoint(call.who.user_id, call.who.org_id, parsed.tinker_path, size)
    with Session(call.db.get_bind()) as s:
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
                user_id=call.who.user_id,
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
    path = twinkle_path(parsed.tinker_path)
    # upstream answers its server directory as checkpoint_dir; we never reveal server paths, and
    # every call that takes a checkpoint_dir (load, upload_to_hub) accepts the twinkle:// path
    return {
        "twinkle_path": path,
        "checkpoint_dir": path,
        "checkpoint_id": parsed.checkpoint_id,
        "size_bytes": size,
    }


def _loader(method: str) -> Callable[[Call, dict], Awaitable[Any]]:
    async def load(call: Call, kw: dict) -> Any:
        _no_server_paths(kw)
        ckpt, src = _checkpoint(call, kw.get("name"), "name")
        _ensure_run_row(call, _spec_of(src))
        kw["name"] = ckpt.storage_dir
        result = await call.invoke(method, kw)
        path = twinkle_path(ckpt.tinker_path)
        return {**result, "checkpoint": path} if isinstance(result, dict) else path

    return load


#: methods the gateway takes part in (validation, runs, quotas, checkpoint rows); every other
#: method of NATIVE_MODEL_METHODS goes to the engine as it is
SPECIAL: dict[str, Callable[[Call, dict], Awaitable[Any]]] = {
    "set_template": _set_template,
    "set_processor": _set_processor,
    "add_adapter_to_model": _add_adapter,
    "save": _save,
    "load": _loader("load"),
    "resume_from_checkpoint": _loader("resume_from_checkpoint"),
    "forward": _metered("forward"),
    "forward_only": _metered("forward_only"),
    "forward_backward": _metered("forward_backward"),
}
