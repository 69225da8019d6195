"""Wire schemas of the native Twinkle routes (``/api/v1/twinkle/...``).

Unknown fields are refused (``extra="forbid"``): the native client is ours, so a misspelt field is
a bug worth a 400 naming it. Method arguments of model calls travel in ``kwargs`` and are checked
against the engine class's own signature (engine/native/host.py).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"


class _Req(BaseModel):
    model_config = ConfigDict(extra="forbid")


class CreateSessionRequest(_Req):
    metadata: dict[str, Any] | None = None
    tags: list[str] = Field(default_factory=list)
    client_version: str | None = Field(default=None, max_length=32)


class HeartbeatRequest(_Req):
    session_id: str


class CreateModelRequest(_Req):
    session_id: str
    base_model: str


class CloseModelRequest(_Req):
    model_id: str


class ModelCallRequest(_Req):
    model_id: str
    adapter_name: str = Field(default="default", pattern=NAME_PATTERN)
    kwargs: dict[str, Any] = Field(default_factory=dict)


class SamplingParamsWire(_Req):
    max_tokens: int = Field(default=64, ge=1, le=8192)
    temperature: float = Field(default=1.0, ge=0)
    top_p: float = Field(default=1.0, gt=0, le=1)
    top_k: int = Field(default=-1, ge=-1)
    seed: int | None = None
    stop: str | list[str] | list[int] | None = None
    num_samples: int = Field(default=1, ge=1, le=64)
    logprobs: int | None = Field(
        default=None, ge=0, le=1, description="accepted; sampled-token logprobs are always returned"
    )
    prompt_logprobs: bool = False


class TemplateSpec(_Req):
    name: str = "Template"
    kwargs: dict[str, Any] = Field(default_factory=dict)


class EncodeRequest(_Req):
    base_model: str
    template: TemplateSpec = Field(default_factory=TemplateSpec)
    inputs: list[dict[str, Any]] = Field(min_length=1, max_length=4096)
    add_generation_prompt: bool = False


class SampleRequest(_Req):
    base_model: str
    template: TemplateSpec = Field(default_factory=TemplateSpec)
    inputs: list[dict[str, Any]] = Field(min_length=1, max_length=256)
    sampling_params: SamplingParamsWire = Field(default_factory=SamplingParamsWire)
    adapter_uri: str | None = None


class SetTemplateRequest(_Req):
    base_model: str
    template: TemplateSpec
