"""The typed engine facades: one real method per Trainer / Sampler method the gateway calls.

Owns: `TrainerClient` (`engine.protocol.TrainerApi`), `SamplerClient` (`SamplerApi`) and
`EveryReplica` (`ReplicaApi` asked of every replica). Each method names the engine method once,
here, and says which argument the call is routed by: a Trainer call about a model goes to the
replica that holds it (its ``model_id``), a call about no model (``info``, ``check_custom_loss``)
to any replica; a Sampler client is bound to an affinity key when it is made. Arguments after the
model id travel as keywords, so a deployment whose parameter names drift fails loudly instead of
binding two values to the wrong parameters.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from engine.protocol import (
    AdamParams,
    CustomLossGraph,
    ForwardBackwardInput,
    ForwardBackwardOutput,
    LoraSpec,
    OptimStepOutput,
    SampleDelta,
    SampleInput,
    SampleOutput,
    SamplerApi,
    TrainerApi,
)

if TYPE_CHECKING:
    from gateway.engine_client.transport import EngineClient


class TrainerClient(TrainerApi):
    """The Trainer of one base model, routed per call by the model it is about."""

    def __init__(self, engine: EngineClient, base_model: str) -> None:
        self._engine, self.base_model = engine, base_model

    async def _about(self, model_id: str, name: str, /, **kwargs: Any) -> Any:
        """The Trainer's ``name(model_id, **kwargs)`` on the replica that holds ``model_id``."""
        return await self._engine._trainer_call(
            self.base_model, model_id, name, (model_id,), kwargs
        )

    async def _any(self, name: str, /, *args: Any) -> Any:
        return await self._engine._trainer_call(self.base_model, None, name, args, {})

    async def info(self) -> dict[str, Any]:
        return await self._any("info")

    async def stats(self) -> dict[str, Any]:
        return await self._any("stats")

    async def check_custom_loss(self, graph: CustomLossGraph) -> None:
        await self._any("check_custom_loss", graph)

    async def status(self, model_id: str, *, seq_id: int) -> dict[str, Any]:
        return await self._about(model_id, "status", seq_id=seq_id)

    async def create_adapter(self, model_id: str, *, spec: LoraSpec, tenant: str = "") -> None:
        await self._about(model_id, "create_adapter", spec=spec, tenant=tenant)

    async def forward_backward(
        self, model_id: str, *, seq_id: int, inp: ForwardBackwardInput
    ) -> ForwardBackwardOutput:
        return await self._about(model_id, "forward_backward", seq_id=seq_id, inp=inp)

    async def optim_step(
        self, model_id: str, *, seq_id: int, params: AdamParams
    ) -> OptimStepOutput:
        return await self._about(model_id, "optim_step", seq_id=seq_id, params=params)

    async def skip(self, model_id: str, *, seq_id: int) -> None:
        await self._about(model_id, "skip", seq_id=seq_id)

    async def save_state(
        self,
        model_id: str,
        *,
        seq_id: int,
        directory: str,
        include_optimizer: bool,
        age_recipients: Sequence[str] = (),
    ) -> int:
        return await self._about(
            model_id,
            "save_state",
            seq_id=seq_id,
            directory=directory,
            include_optimizer=include_optimizer,
            age_recipients=tuple(age_recipients),
        )

    async def load_state(
        self,
        model_id: str,
        *,
        seq_id: int | None,
        directory: str,
        include_optimizer: bool,
        tenant: str = "",
    ) -> LoraSpec:
        return await self._about(
            model_id,
            "load_state",
            seq_id=seq_id,
            directory=directory,
            include_optimizer=include_optimizer,
            tenant=tenant,
        )

    async def delete_adapter(self, model_id: str) -> None:
        await self._about(model_id, "delete_adapter")

    async def native_create(self, model_id: str, *, tenant: str) -> dict[str, Any]:
        return await self._about(model_id, "native_create", tenant=tenant)

    async def native_call(
        self, model_id: str, *, tenant: str, method: str, adapter_name: str, kwargs: dict
    ) -> Any:
        return await self._about(
            model_id,
            "native_call",
            tenant=tenant,
            method=method,
            adapter_name=adapter_name,
            kwargs=kwargs,
        )

    async def native_adapters(self, model_id: str, *, tenant: str) -> list[str]:
        return await self._about(model_id, "native_adapters", tenant=tenant)

    async def native_close(self, model_id: str, *, tenant: str) -> None:
        await self._about(model_id, "native_close", tenant=tenant)


class SamplerClient(SamplerApi):
    """A Sampler replica of one base model, chosen by the affinity key the client was made with
    (the same key, the same replica: its adapter cache stays warm)."""

    def __init__(self, engine: EngineClient, base_model: str, affinity: str | None) -> None:
        self._engine, self.base_model, self.affinity = engine, base_model, affinity

    async def _call(self, name: str, /, *args: Any, **kwargs: Any) -> Any:
        target = self._engine._sampler_target(self.base_model, self.affinity)
        return await self._engine._call(target, name, args, kwargs)

    async def info(self) -> dict[str, Any]:
        return await self._call("info")

    async def stats(self) -> dict[str, Any]:
        return await self._call("stats")

    async def sample(self, inp: SampleInput) -> SampleOutput:
        return await self._call("sample", inp)

    async def sample_stream(self, inp: SampleInput) -> AsyncIterator[SampleDelta]:
        target = self._engine._sampler_target(self.base_model, self.affinity)
        async for delta in self._engine._stream(target, "sample_stream", (inp,), {}):
            yield delta

    async def encode_chat(
        self, messages: list[dict], *, add_generation_prompt: bool = True
    ) -> list[int]:
        return await self._call(
            "encode_chat", messages, add_generation_prompt=add_generation_prompt
        )

    async def encode_chat_images(
        self, messages: list[dict], *, image_fields: list[str], add_generation_prompt: bool = True
    ) -> tuple[list[int], list[int]]:
        return await self._call(
            "encode_chat_images",
            messages,
            image_fields=image_fields,
            add_generation_prompt=add_generation_prompt,
        )

    async def encode_text(self, text: str) -> list[int]:
        return await self._call("encode_text", text)

    async def decode(self, tokens: list[int]) -> str:
        return await self._call("decode", tokens)

    async def decode_pieces(self, tokens: list[int]) -> list[str]:
        return await self._call("decode_pieces", tokens)

    async def eos_token(self) -> str | None:
        return await self._call("eos_token")

    async def image_token_id(self) -> int | None:
        return await self._call("image_token_id")

    async def encode_trajectory(
        self,
        messages: list[dict],
        *,
        add_generation_prompt: bool = False,
        options: Mapping[str, Any] | None = None,
        field: str = "inputs[0]",
    ) -> dict[str, list[int]]:
        return await self._call(
            "encode_trajectory",
            messages,
            add_generation_prompt=add_generation_prompt,
            options=dict(options or {}),
            field=field,
        )

    async def tokenizer_files(self) -> dict[str, int]:
        return await self._call("tokenizer_files")

    async def tokenizer_file(self, name: str) -> bytes:
        return await self._call("tokenizer_file", name)


class EveryReplica:
    """Every replica of one role of a base model, asked one after another, in replica order
    (readiness, per-replica stats): `ReplicaApi`'s methods, one answer per replica."""

    def __init__(self, engine: EngineClient, targets: list[Any]) -> None:
        self._engine, self._targets = engine, targets

    async def info(self) -> list[dict[str, Any]]:
        return [await self._engine._call(t, "info", (), {}) for t in self._targets]

    async def stats(self) -> list[dict[str, Any]]:
        return [await self._engine._call(t, "stats", (), {}) for t in self._targets]
