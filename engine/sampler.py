"""The Sampler: generates from a base model or from saved adapter checkpoints.

In-process or as a Ray Serve deployment (engine/app.py). One worker thread runs the backend; the
backend caches adapters by checkpoint directory, so an evicted adapter is reloaded, never a 404.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

from engine.backends.base import SamplingBackend
from engine.config import ModelConfig
from engine.protocol import SampleInput, SampleOutput


def build_sampling_backend(model: ModelConfig, data_dir: str) -> SamplingBackend:
    from engine.backends.torch_sampler import TorchSamplingBackend
    from engine.models.registry import resolve_model_dir

    return TorchSamplingBackend(str(resolve_model_dir(model.name, data_dir, model.path)))


class Sampler:
    def __init__(
        self, model: ModelConfig | dict, data_dir: str, *, backend: SamplingBackend | None = None
    ) -> None:
        self.model = model if isinstance(model, ModelConfig) else ModelConfig.model_validate(model)
        self.backend = backend or build_sampling_backend(self.model, data_dir)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sampler")

    async def info(self) -> dict:
        return {"base_model": self.model.name, "vocab_size": self.backend.vocab_size}

    async def sample(self, inp: SampleInput) -> SampleOutput:
        return await asyncio.get_running_loop().run_in_executor(
            self._pool, lambda: self.backend.sample(inp)
        )
