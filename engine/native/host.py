"""The native models a Trainer replica hosts, keyed by model id.

A native model (``POST /api/v1/model/<base>/twinkle/create``: one per session and base model) is
the engine's own `MultiLoraTransformersModel` whose compute runs through this Trainer
(`SequencedTrainerBackend`). Its state (loss, optimizer, LR schedule, template and processor
settings, accumulation counters, metrics, the inputs `forward` cached for `backward`) lives here,
next to its adapters, so any gateway replica can serve any call: the gateway routes every call by
model id (`engine.rules.trainer_route_key`) and keeps only who owns the model. A Trainer restart
loses them, as it loses the adapters; the gateway then answers 404 and the client recreates the
model and resumes from a checkpoint.

Calls on one model run one at a time, in arrival order (one lock per model: the class is not
thread-safe); calls on different models run concurrently on worker threads and meet in the
Trainer's fair scheduler.
"""

from __future__ import annotations

import asyncio
import inspect
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engine.errors import AdapterNotFoundError, UserInputError
from engine.local.model import MultiLoraTransformersModel
from engine.native.sequenced_backend import SequencedTrainerBackend
from engine.rules import NATIVE_MODEL_METHODS

if TYPE_CHECKING:
    from engine.trainer import Trainer

#: worker threads driving native models; each one mostly waits for the Trainer's single compute
#: thread, so this only bounds how many models queue compute at once (more wait for a worker)
NATIVE_WORKERS = 16


@dataclass
class _Hosted:
    model: MultiLoraTransformersModel
    tenant: str
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


def _not_found(model_id: str) -> AdapterNotFoundError:
    return AdapterNotFoundError(
        f"model_id: model {model_id!r} not found (the server may have restarted: create the "
        "model again and resume_from_checkpoint)"
    )


class NativeModelHost:
    def __init__(self, trainer: Trainer, data_dir: str | Path) -> None:
        self._trainer = trainer
        self._data_dir = Path(data_dir)
        self._models: dict[str, _Hosted] = {}
        self._pool = ThreadPoolExecutor(NATIVE_WORKERS, thread_name_prefix="native-model")

    def _get(self, model_id: str, tenant: str) -> _Hosted:
        hosted = self._models.get(model_id)
        if hosted is None or hosted.tenant != tenant:  # the gateway checked ownership already
            raise _not_found(model_id)
        return hosted

    async def _run(self, hosted: _Hosted, fn) -> Any:
        async with hosted.lock:
            return await asyncio.get_running_loop().run_in_executor(self._pool, fn)

    async def create(self, model_id: str, tenant: str) -> dict[str, Any]:
        """Host a new, empty model (adapters come with add_adapter_to_model). Repeating it for the
        same tenant (a retried request) keeps the model."""
        hosted = self._models.get(model_id)
        if hosted is None:
            backend = SequencedTrainerBackend(
                self._trainer, asyncio.get_running_loop(), model_id=model_id, tenant=tenant
            )
            model = MultiLoraTransformersModel(
                self._trainer.model.name, backend=backend, data_dir=self._data_dir
            )
            hosted = self._models[model_id] = _Hosted(model, tenant)
        elif hosted.tenant != tenant:
            raise UserInputError(f"model_id: {model_id!r} is taken")
        return {"model_id": model_id, "max_lora_rank": hosted.model.backend.max_lora_rank}

    async def call(
        self, model_id: str, tenant: str, method: str, adapter_name: str, kwargs: dict[str, Any]
    ) -> Any:
        """``model.<method>(adapter_name=..., **kwargs)``, its arguments checked against the
        engine class's own signature (a 400 naming the argument, as the in-process call)."""
        if method not in NATIVE_MODEL_METHODS:
            raise UserInputError(f"method: {method!r} is not a model method")
        hosted = self._get(model_id, tenant)
        fn = getattr(hosted.model, method)
        try:
            inspect.signature(fn).bind(adapter_name=adapter_name, **kwargs)
        except TypeError as exc:
            raise UserInputError(f"kwargs: {method}() {exc}") from None
        return await self._run(hosted, lambda: fn(adapter_name=adapter_name, **kwargs))

    async def adapters(self, model_id: str, tenant: str) -> list[str]:
        """The model's adapter names."""
        return self._get(model_id, tenant).model.adapter_names

    async def close(self, model_id: str, tenant: str) -> None:
        """Drop the model's adapters from the Trainer and forget the model (its runs and
        checkpoints stay in the gateway's DB). A no-op for an unknown model."""
        hosted = self._models.get(model_id)
        if hosted is None or hosted.tenant != tenant:
            return
        model = hosted.model

        def remove_all() -> None:
            for name in list(model.adapter_names):
                model.remove_adapter(name)

        await self._run(hosted, remove_all)
        self._models.pop(model_id, None)

    def model_ids(self) -> list[str]:
        return list(self._models)
