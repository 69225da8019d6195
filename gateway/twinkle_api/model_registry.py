"""Live native models: the gateway-side `MultiLoraTransformersModel` instances and who owns them.

A native model is created by ``POST /twinkle/model/create`` within one of the caller's sessions
and lives in this gateway process (its adapters live in the shared Trainer, their rows and
checkpoints in the DB). Lookups filter by the caller's user id and answer 404 otherwise, as every
other ownership check does. After a gateway restart the client gets a 404 that says to recreate
the model and resume from a checkpoint.
"""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from fastapi import Request

from engine.local.model import MultiLoraTransformersModel
from engine.local.training_config import check_clip
from gateway.errors import NotFoundError
from gateway.twinkle_api.proxy_backend import TrainerProxyBackend


class ServedModel(MultiLoraTransformersModel):
    """The engine class with the two methods that read gradients directly (`clip_grad_norm`,
    `zero_grad`) going through the Trainer instead (`TrainerProxyBackend.grad_op`); same
    signatures and semantics as the engine's."""

    backend: TrainerProxyBackend

    def clip_grad_norm(
        self, max_grad_norm: float = 1.0, norm_type: float = 2, *, adapter_name: str = "default"
    ) -> float | None:
        st = self._st(adapter_name)
        st.clip = check_clip(max_grad_norm, norm_type)
        if not st.pending_grad:
            return 0.0
        return self.backend.grad_op(adapter_name, "norm")

    def zero_grad(self, *, adapter_name: str = "default") -> None:
        st = self._st(adapter_name)
        if st.micro != 0 or not st.pending_grad:
            return
        self.backend.grad_op(adapter_name, "zero")
        st.pending_grad = False


@dataclass
class NativeModel:
    model_id: str
    user_id: int
    session_id: str
    base_model: str
    model: ServedModel
    proxy: TrainerProxyBackend
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


class NativeModels:
    def __init__(self) -> None:
        self._models: dict[str, NativeModel] = {}

    @staticmethod
    def new_id(session_id: str) -> str:
        return f"{session_id}:tw-{uuid.uuid4().hex[:8]}"

    def add(self, nm: NativeModel) -> None:
        self._models[nm.model_id] = nm

    def owned(self, model_id: str, user_id: int) -> NativeModel:
        nm = self._models.get(model_id)
        if nm is None or nm.user_id != user_id:
            raise NotFoundError(
                f"model_id: model {model_id!r} not found (the server may have restarted: create "
                "the model again and resume_from_checkpoint)"
            )
        return nm

    def drop(self, model_id: str) -> None:
        self._models.pop(model_id, None)


def native_models(request: Request) -> NativeModels:
    """The app's registry, created on first use (so gateway/main.py needs no lifespan change)."""
    reg = getattr(request.app.state, "twinkle_models", None)
    if reg is None:
        reg = request.app.state.twinkle_models = NativeModels()
    return reg


def make_native_model(
    *, engine, loop, model_id: str, base_model: str, tenant: str, info: dict, data_dir: Path
) -> tuple[ServedModel, TrainerProxyBackend]:
    proxy = TrainerProxyBackend(
        engine,
        loop,
        base_model=base_model,
        model_id=model_id,
        tenant=tenant,
        vocab_size=int(info["vocab_size"]),
        max_lora_rank=int(info["max_lora_rank"]),
    )
    return ServedModel(base_model, backend=proxy, data_dir=data_dir), proxy
