"""Upstream Twinkle's native model protocol (twinkle-kit 0.5.1's ``MultiLoraTransformersModel``):
``POST /api/v1/model/<base_model>/twinkle/<method>``.

The client names no model id: a model is the caller's session (``X-Twinkle-Session-Id``, which
must be one of the caller's sessions) on one base model, and its adapters are named per call by
``adapter_name``. ``create`` hosts the model in the Trainer (engine/native/host.py: the engine's
own `MultiLoraTransformersModel`); every other method is forwarded to it with the body's fields
as keyword arguments, renamed where upstream's client names them differently (``loss_cls`` →
``loss`` ...). The engine binds them against the method's signature, so an unknown or missing
argument is a 400 naming it. model_calls.py adds what needs the DB (runs, quotas, checkpoints).

Answers have upstream's shapes: ``{"result": ...}`` for the methods whose upstream response
carries one, ``{"status": "ok"}`` (plus our ``result`` where there is one) for the others;
``save`` answers ``{"twinkle_path", "checkpoint_dir"}`` without any server path. Where upstream
answers a 500 with a traceback, this answers a 4xx naming the field; class names are an
allow-list (nothing is imported or instantiated by name).
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any

from fastapi import APIRouter, Body

from engine.rules import NATIVE_MODEL_METHODS
from gateway.context import ContextDep
from gateway.deps import EngineDep, PrincipalDep
from gateway.errors import InvalidRequestError, NotFoundError, NotImplementedOnServerError
from gateway.twinkle_api.model_calls import SPECIAL, Call, jsonable
from gateway.twinkle_api.model_registry import NativeModel, NativeModelsDep
from gateway.twinkle_api.native_deps import (
    BaseModelDep,
    NativeSessionDep,
    OwnedModelDep,
    session_model_id,
)
from gateway.twinkle_api.schemas import NAME_PATTERN

router = APIRouter(prefix="/api/v1/model")

#: upstream's body field for the class name → the engine method's argument
_CLASS_ARG = {
    "set_loss": ("loss_cls", "loss"),
    "set_optimizer": ("optimizer_cls", "optimizer"),
    "set_lr_scheduler": ("scheduler_cls", "scheduler"),
    "set_template": ("template_cls", "template"),
    "set_processor": ("processor_cls", "processor"),
    "add_metric": ("metric_cls", "metric_cls"),
}
#: methods whose upstream answer is ``{"result": ...}``; the rest answer ``{"status": "ok"}``
_RESULT_METHODS = {
    "forward",
    "forward_only",
    "forward_backward",
    "calculate_loss",
    "clip_grad_norm",
    "calculate_metric",
    "get_train_configs",
    "resume_from_checkpoint",
}
_UNAVAILABLE = {
    "upload_to_hub": "no model hub is configured on this server; download checkpoints with the "
    "Tinker RestClient (get_checkpoint_archive_url) or load them by twinkle:// path",
    "get_state_dict": "adapter weights are not returned over the API; save a checkpoint "
    "(model.save) and download it, or load it by twinkle:// path",
    "apply_patch": "no model patches are available on this server",
}


@router.post("/{base_model:path}/twinkle/create")
async def create(
    name: BaseModelDep,
    session: NativeSessionDep,
    who: PrincipalDep,
    engine: EngineDep,
    models: NativeModelsDep,
    body: Annotated[dict[str, Any] | None, Body()] = None,
) -> dict:
    """Host the session's model on the base model (idempotent: a second client object in the
    same session shares it, as upstream's server does)."""
    model_id = session_model_id(session.id, name)
    try:
        nm = await models.owned(model_id, who.user_id)
    except NotFoundError:
        nm = None
    info = await engine.trainer(name).native_create(model_id, tenant=str(who.user_id))
    if nm is None:
        rank = int(info["max_lora_rank"])
        await models.add(NativeModel(model_id, who.user_id, session.id, name, rank))
    return {"status": "ok", "base_model": name, "max_lora_rank": int(info["max_lora_rank"])}


def _adapter_name(body: dict[str, Any], method: str) -> str:
    name = body.pop("adapter_name", None)
    if method == "add_adapter_to_model" and not name:
        raise InvalidRequestError("adapter_name: required")
    name = name or "default"
    if not isinstance(name, str) or not re.fullmatch(NAME_PATTERN, name):
        raise InvalidRequestError(
            f"adapter_name: {name!r} must be 1-64 letters, digits, '.', '_' or '-' (starting "
            "with a letter or digit)"
        )
    return name


def _kwargs(method: str, body: dict[str, Any]) -> dict[str, Any]:
    """Upstream's flat body as the engine method's keyword arguments."""
    kw = dict(body)
    if method in _CLASS_ARG:
        wire, arg = _CLASS_ARG[method]
        if not isinstance(kw.get(wire), str) or not kw[wire]:
            raise InvalidRequestError(f"{wire}: a class name (string) is required")
        kw[arg] = kw.pop(wire)
    if method == "add_metric" and kw.get("is_training") is None:
        kw.pop("is_training", None)
    return kw


def _answer(method: str, result: Any) -> dict:
    if method == "save":
        return jsonable(result)
    if method == "get_train_configs":  # upstream: a string (its client's type is `str`)
        return {"result": json.dumps(jsonable(result), sort_keys=True)}
    if method == "clip_grad_norm":  # upstream: the norm as a string
        return {"result": str(result)}
    if method in _RESULT_METHODS:
        return {"result": jsonable(result)}
    out: dict[str, Any] = {"status": "ok"}
    if result is not None:
        out["result"] = jsonable(result)
    return out


@router.post("/{base_model:path}/twinkle/{method}")
async def call(
    method: str,
    nm: OwnedModelDep,
    ctx: ContextDep,
    body: Annotated[dict[str, Any] | None, Body()] = None,
) -> dict:
    if method in _UNAVAILABLE:
        raise NotImplementedOnServerError(
            f"{method}: not available on this server: " + _UNAVAILABLE[method]
        )
    if method not in NATIVE_MODEL_METHODS:
        raise NotFoundError(
            f"method: {method!r} is not a model method; available: "
            f"create, {', '.join(sorted(NATIVE_MODEL_METHODS))}"
        )
    body = dict(body or {})
    adapter = _adapter_name(body, method)
    kw = _kwargs(method, body)
    c = Call(ctx.in_session(nm.session_id), nm, adapter)
    handler = SPECIAL.get(method)
    result = await (handler(c, kw) if handler else c.invoke(method, kw))
    return _answer(method, result)


@router.get("/{base_model:path}/twinkle/upload_status/{request_id}")
async def upload_status(name: BaseModelDep, request_id: str, who: PrincipalDep) -> dict:
    raise NotFoundError(f"request_id: no upload {request_id!r} (uploads are not available here)")


@router.get("/{base_model:path}/healthz")
async def healthz(name: BaseModelDep) -> dict:
    """Liveness of one base model's routes (upstream's per-model health check)."""
    return {"healthy": True, "detail": name}
