"""What the gateway adds to a native model call before the engine runs it: the calls that need
the DB, quotas or checkpoint storage (model_routes.py routes every call here or to the engine).

A native model is the engine's `MultiLoraTransformersModel`, hosted by the Trainer replica that
holds its adapters (engine/native/host.py). The engine checks the call's kwargs against the
method's own signature, so a remote call behaves exactly as the in-process call, including its
errors (400 naming the argument or rule). What the gateway adds is what needs the DB and
quotas: each adapter is a training run of the caller's (opened under the Tinker create_model
quotas by every call that creates one: add_adapter_to_model, and load / resume_from_checkpoint
into a new adapter name), and checkpoints are names and ``twinkle://`` paths instead of
server directories (``output_dir`` is refused), recorded as the caller's checkpoints of the
adapter's run, so the Tinker RestClient and the native management calls list and delete them
alike.
"""

from __future__ import annotations

import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from engine.protocol import LoraSpec
from engine.rules import lora_spec_from_config
from gateway.context import RequestContext
from gateway.db.tables import CheckpointRow, TrainingRunRow
from gateway.errors import InvalidRequestError, NotFoundError
from gateway.runs.checkpoints import ParsedPath, readable_checkpoint, validate_name
from gateway.training import checkpoints, metering, runs
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
    """One ``model/{method}`` call: the caller's request context (bound to the model's session),
    the owned model and the adapter it names."""

    ctx: RequestContext
    nm: NativeModel
    adapter: str

    async def invoke(self, method: str, kwargs: dict) -> Any:
        nm = self.nm
        return await self.ctx.engine.trainer(nm.base_model).native_call(
            nm.model_id, tenant=nm.tenant, method=method, adapter_name=self.adapter, kwargs=kwargs
        )

    async def has_adapter(self) -> bool:
        nm = self.nm
        names = await self.ctx.engine.trainer(nm.base_model).native_adapters(
            nm.model_id, tenant=nm.tenant
        )
        return self.adapter in names

    def run_row(self, spec: LoraSpec) -> TrainingRunRow:
        """The adapter's run, as a new row (the caller's, in the model's session)."""
        nm = self.nm
        return runs.new_run_row(
            nm.run_id(self.adapter),
            nm.session_id,
            self.ctx.who.user_id,
            nm.base_model,
            spec,
            {"client": "twinkle", "adapter_name": self.adapter},
        )


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
        n = count_tokens(kw.get("inputs"))
        await metering.charge_training(call.ctx, n)
        result = await call.invoke(method, kw)
        nm = call.nm
        metering.record_training(call.ctx.usage, call.ctx.who, nm.session_id, nm.base_model, n)
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
    ckpt = readable_checkpoint(call.ctx.db, call.ctx.who.user_id, ref, field)
    src = call.ctx.db.get(TrainingRunRow, ckpt.run_id)
    if src is None or src.base_model != call.nm.base_model:
        base = src.base_model if src else "?"
        raise InvalidRequestError(
            f"{field}: checkpoint was trained on {base}, this model is {call.nm.base_model}"
        )
    return ckpt, src


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
    if kw.get("config") is None:
        raise InvalidRequestError(
            "config: a LoRA config is required (full-parameter training is not offered: the "
            "base model is shared by every tenant)"
        )
    # upstream's client sends its own machine's directory; checkpoints live in the server's
    # managed storage under twinkle:// names instead (model.save returns the path)
    kw.pop("save_dir", None)
    if await call.has_adapter():
        raise InvalidRequestError(f"adapter_name: {call.adapter!r} exists already in this model")
    config = kw["config"] = _lora_config(kw["config"])
    if isinstance(config, str):  # start from a checkpoint's weights
        ckpt, src = _checkpoint(call, config, "config")
        spec = runs.spec_of(src)
        kw["config"] = ckpt.storage_dir
    elif isinstance(config, dict):
        spec = lora_spec_from_config(config)
        nm = call.nm
        runs.check_rank("config.r: rank", spec.rank, nm.max_lora_rank, nm.base_model)
    else:
        raise InvalidRequestError("config: must be a LoRA config or a checkpoint path")
    await _creating(call, spec, "add_adapter_to_model", kw)


async def _creating(call: Call, spec: LoraSpec, method: str, kw: dict) -> Any:
    """``method`` creating the call's adapter with ``spec``, under the quotas of Tinker's
    create_model (`runs.open_run`: the rank cap and a training-client slot, 403 at either). Every
    call that can create an adapter (add_adapter_to_model, and load / resume_from_checkpoint into
    a new adapter name) comes here. Re-added after remove_adapter, the run (and its checkpoints)
    continue."""
    row = call.run_row(spec)
    created = await runs.open_run(call.ctx, row)
    try:
        return await call.invoke(method, kw)
    except BaseException:
        if created:
            await runs.close_unused_run(call.ctx, row)
        raise


async def _save(call: Call, kw: dict) -> dict:
    """A save under the checkpoint quotas and in the usage ledger, as a Tinker save
    (`gateway.training.checkpoints`); the same name again replaces the checkpoint (as upstream)."""
    _no_server_paths(kw)
    kw.pop("save_dir", None)  # a client-machine directory (upstream): storage is the server's
    # upstream's name is optional; unnamed checkpoints get the time, as its server does
    name = validate_name(kw.get("name") or time.strftime("%Y%m%d_%H%M%S"), "name")
    run = call.ctx.db.get(TrainingRunRow, call.nm.run_id(call.adapter))
    if run is None or not await call.has_adapter():
        raise NotFoundError(f"adapter_name: adapter {call.adapter!r} is not in this model")
    meta = {}
    if kw.get("consumed_train_samples") is not None:
        meta["consumed_train_samples"] = kw["consumed_train_samples"]
    kind = "sampler" if kw.get("is_sampler") else "training"
    spec = checkpoints.SaveSpec(kind, name, True, None, meta, bool(kw.get("save_optimizer")))
    res = await checkpoints.reserve(call.ctx, run, spec)
    kw.update(name=res.directory.name, output_dir=str(res.directory.parent))

    async def save() -> int:
        await call.invoke("save", kw)
        return checkpoints.directory_size(res.directory)

    size = await checkpoints.write(call.ctx, run, spec, res, save)
    checkpoints.record(call.ctx.db.get_bind(), call.ctx.who.user_id, run, spec, res, size)
    path = twinkle_path(res.parsed.tinker_path)
    # upstream answers its server directory as checkpoint_dir; we never reveal server paths, and
    # every call that takes a checkpoint_dir (load, upload_to_hub) accepts the twinkle:// path
    return {
        "twinkle_path": path,
        "checkpoint_dir": path,
        "checkpoint_id": res.parsed.checkpoint_id,
        "size_bytes": size,
    }


def _loader(method: str) -> Callable[[Call, dict], Awaitable[Any]]:
    async def load(call: Call, kw: dict) -> Any:
        _no_server_paths(kw)
        ckpt, src = _checkpoint(call, kw.get("name"), "name")
        kw["name"] = ckpt.storage_dir
        if await call.has_adapter():  # in place: the engine refuses a checkpoint of another shape
            result = await call.invoke(method, kw)
        else:  # into a new adapter name: the load creates it, with the checkpoint's shape
            spec = runs.spec_of(src)
            nm = call.nm
            runs.check_rank(
                "name: the checkpoint's rank", spec.rank, nm.max_lora_rank, nm.base_model
            )
            result = await _creating(call, spec, method, kw)
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
