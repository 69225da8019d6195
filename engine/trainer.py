"""The Trainer: one base model, many tenants' adapters, requests run in seq_id order per model.

Works in-process (tests, the native local API) and as a Ray Serve deployment (see engine/app.py):
every public method is a coroutine. Compute runs on one worker thread, so the event loop stays free
to accept and order requests while a step runs. Scheduling across tenants is FIFO by arrival at the
worker for now.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from engine.backends.base import TrainingBackend
from engine.config import ModelConfig
from engine.protocol import (
    AdamParams,
    ForwardBackwardInput,
    ForwardBackwardOutput,
    LoraSpec,
    OptimStepOutput,
)
from engine.sequencer import Sequencer

log = logging.getLogger(__name__)
T = TypeVar("T")


def build_training_backend(model: ModelConfig, data_dir: str) -> TrainingBackend:
    """Resolve the model folder (building the tiny model if needed) and load the backend."""
    from engine.backends.transformers_backend import TransformersTrainingBackend
    from engine.models.registry import resolve_model_dir

    model_dir = resolve_model_dir(model.name, data_dir, model.path)
    return TransformersTrainingBackend(
        str(model_dir), max_lora_rank=model.max_lora_rank, base_model_name=model.name
    )


class Trainer:
    def __init__(
        self,
        model: ModelConfig | dict,
        data_dir: str,
        *,
        gap_timeout: float = 120.0,
        backend: TrainingBackend | None = None,
    ) -> None:
        self.model = model if isinstance(model, ModelConfig) else ModelConfig.model_validate(model)
        _limit_threads()
        self.backend = backend or build_training_backend(self.model, data_dir)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="trainer")
        self._seq = Sequencer(gap_timeout)

    async def _run(self, fn: Callable[[], T]) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn)

    async def info(self) -> dict:
        return {
            "base_model": self.model.name,
            "vocab_size": self.backend.vocab_size,
            "max_lora_rank": self.backend.max_lora_rank,
            "max_context_length": getattr(self.backend, "max_positions", None),
        }

    async def create_adapter(self, model_id: str, spec: LoraSpec) -> None:
        """The model's seq 0: afterwards its next request is seq 1."""
        await self._run(lambda: self.backend.create_adapter(model_id, spec))
        self._seq.start(model_id, 1)

    async def load_state(
        self, model_id: str, seq_id: int | None, directory: str, include_optimizer: bool
    ) -> LoraSpec:
        """Create-via-load (``seq_id`` None: this is the model's seq 0) or an in-order load."""
        if seq_id is None:
            spec = await self._run(
                lambda: self.backend.load_state(model_id, directory, include_optimizer=include_optimizer)
            )
            self._seq.start(model_id, 1)
            return spec
        async with self._seq.turn(model_id, seq_id):
            return await self._run(
                lambda: self.backend.load_state(model_id, directory, include_optimizer=include_optimizer)
            )

    async def forward_backward(
        self, model_id: str, seq_id: int, inp: ForwardBackwardInput
    ) -> ForwardBackwardOutput:
        async with self._seq.turn(model_id, seq_id):
            return await self._run(lambda: self.backend.forward_backward(model_id, inp))

    async def optim_step(self, model_id: str, seq_id: int, params: AdamParams) -> OptimStepOutput:
        async with self._seq.turn(model_id, seq_id):
            return await self._run(lambda: self.backend.optim_step(model_id, params))

    async def save_state(
        self, model_id: str, seq_id: int, directory: str, include_optimizer: bool
    ) -> int:
        async with self._seq.turn(model_id, seq_id):
            return await self._run(
                lambda: self.backend.save_state(model_id, directory, include_optimizer=include_optimizer)
            )

    async def skip(self, model_id: str, seq_id: int) -> None:
        """Let a request the gateway rejected pass the ordering, so later ones are not held up."""
        async with self._seq.turn(model_id, seq_id):
            pass

    async def delete_adapter(self, model_id: str) -> None:
        await self._run(lambda: self.backend.delete_adapter(model_id))
        self._seq.forget(model_id)

    async def queue_depth(self, model_id: str) -> int:
        return self._seq.pending(model_id)


def _limit_threads() -> None:
    """Each replica gets a share of the CPUs; oversubscribing torch threads slows every tenant."""
    import os

    import torch

    n = int(os.environ.get("TWINKLE_TORCH_THREADS", "0") or 0)
    if n > 0:
        torch.set_num_threads(n)
