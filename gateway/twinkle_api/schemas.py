"""Wire schemas of the native Twinkle routes (``/api/v1/twinkle/...``).

Unknown fields are refused (``extra="forbid"``) where upstream's client sends a fixed set, so a
misspelt field is a 400 naming it. Model calls (model_routes.py) take upstream's flat bodies:
their fields are checked against the engine class's own signature (engine/native/host.py).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from gateway.deps import SEED_MAX, SEED_MIN, Tags, UserMetadata

NAME_PATTERN = r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}"  # for re.fullmatch


class _Req(BaseModel):
    model_config = ConfigDict(extra="forbid")


class CreateSessionRequest(_Req):
    metadata: UserMetadata = None
    tags: Tags = Field(default_factory=list)
    client_version: str | None = Field(default=None, max_length=32)


class HeartbeatRequest(_Req):
    session_id: str


class SamplingParamsWire(_Req):
    """Upstream's ``SamplingParams`` fields (twinkle.data_format)."""

    max_tokens: int | None = Field(default=None, ge=1, le=8192, description="default 256")
    temperature: float = Field(default=1.0, ge=0)
    top_p: float = Field(default=1.0, gt=0, le=1)
    top_k: int = Field(default=-1, ge=-1)
    seed: int | None = Field(default=None, ge=SEED_MIN, le=SEED_MAX)
    stop: str | list[str] | list[int] | None = None
    repetition_penalty: float = Field(default=1.0, description="only 1.0 (off) is served")
    num_samples: int | None = Field(default=None, ge=1, le=64)
    logprobs: int | None = Field(
        default=None, ge=0, le=1, description="the sampled token's logprob is always returned"
    )
    prompt_logprobs: int | bool | None = None


class TemplateSpec(_Req):
    name: str = "Template"
    kwargs: dict[str, Any] = Field(default_factory=dict)


class EncodeRequest(_Req):
    base_model: str
    template: TemplateSpec = Field(default_factory=TemplateSpec)
    inputs: list[dict[str, Any]] = Field(min_length=1, max_length=4096)
    add_generation_prompt: bool = False
    label_format: Literal["rolled", "hf"] = Field(
        default="rolled",
        description="rolled: labels[i] is the target of input_ids[i] (upstream's templates); "
        "hf: labels[i] == input_ids[i] on trained positions (the model shifts)",
    )


class SampleRequest(_Req):
    """``POST /api/v1/sampler/<base>/twinkle/sample`` (upstream's body)."""

    inputs: list[dict[str, Any]] | dict[str, Any]
    sampling_params: SamplingParamsWire | None = None
    adapter_name: str | None = ""
    adapter_uri: str | None = None
    num_samples: int = Field(default=1, ge=1, le=64)


class SamplerTemplateRequest(BaseModel):
    """``POST /api/v1/sampler/<base>/twinkle/set_template``: the class name plus its options
    (upstream's client also sends ``adapter_name`` and ``model_id``)."""

    model_config = ConfigDict(extra="allow")
    template_cls: str
    adapter_name: str | None = ""
    model_id: str | None = None
