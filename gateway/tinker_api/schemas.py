"""Wire schemas of the Tinker JSON endpoints (requests and responses), as tinker 0.38.0 sends them.

Requests ignore unknown fields (newer SDKs add fields; refusing them would break old servers' promise
of "existing code runs unchanged"), but every known field is type-checked and a violation is a 400
naming the field. Responses carry every field the SDK's strict response validation requires.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class _Req(BaseModel):
    model_config = ConfigDict(extra="ignore")


class ClientConfigRequest(_Req):
    sdk_version: str | None = None


class CreateSessionRequest(_Req):
    tags: list[str] = Field(default_factory=list)
    user_metadata: dict[str, Any] | None = None
    sdk_version: str | None = None
    project_id: str | None = None
    display_name: str | None = None


class SessionHeartbeatRequest(_Req):
    session_id: str


class FinishReason(_Req):
    type: str = "success"


class FinishSessionRequest(_Req):
    reason: FinishReason | None = None
    detail: str | None = None


class LoraConfigWire(_Req):
    rank: int = Field(32, ge=1)
    seed: int | None = None
    train_unembed: bool = True
    train_mlp: bool = True
    train_attn: bool = True


class CreateModelRequest(_Req):
    session_id: str
    model_seq_id: int = Field(ge=0)
    base_model: str
    lora_config: LoraConfigWire = Field(default_factory=LoraConfigWire)
    user_metadata: dict[str, Any] | None = None
    optimizer_config: dict[str, Any] | None = None


class GetInfoRequest(_Req):
    model_id: str


class AdamParamsWire(_Req):
    learning_rate: float = Field(1e-4, ge=0)
    beta1: float = Field(0.9, ge=0, lt=1)
    beta2: float = Field(0.95, ge=0, lt=1)
    eps: float = Field(1e-12, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    grad_clip_norm: float = Field(0.0, ge=0)


class OptimStepRequest(_Req):
    model_id: str
    seq_id: int = Field(ge=1)
    adam_params: AdamParamsWire | None = None
    optimizer_params: dict[str, Any] | None = None


class SaveWeightsRequest(_Req):
    model_id: str
    seq_id: int = Field(ge=1)
    path: str | None = None
    overwrite: bool = False
    ttl_seconds: int | None = Field(None, ge=1)
    user_metadata: dict[str, Any] | None = None


class SaveWeightsForSamplerRequest(_Req):
    model_id: str
    seq_id: int = Field(ge=1)
    path: str | None = None
    sampling_session_seq_id: int | None = Field(None, ge=0)
    kind: str | None = None
    ttl_seconds: int | None = Field(None, ge=1)
    user_metadata: dict[str, Any] | None = None


class LoadWeightsRequest(_Req):
    path: str
    optimizer: bool = False
    # create-via-load
    session_id: str | None = None
    model_seq_id: int | None = Field(None, ge=0)
    base_model: str | None = None
    user_metadata: dict[str, Any] | None = None
    # legacy in-place load
    model_id: str | None = None
    seq_id: int | None = Field(None, ge=1)


class SaveWeightsExternalRequest(_Req):
    model_id: str
    path: str
    seq_id: int = Field(ge=1)
    ttl_seconds: int | None = Field(None, ge=1)
    age_encryption_recipients: list[str] | None = None


class CreateSamplingSessionRequest(_Req):
    session_id: str
    sampling_session_seq_id: int = Field(ge=0)
    base_model: str | None = None
    model_path: str | None = None


class EncodedTextChunkWire(_Req):
    type: Literal["encoded_text"] = "encoded_text"
    tokens: list[int]


class ModelInputWire(_Req):
    chunks: list[dict[str, Any]]


class SamplingParamsWire(_Req):
    max_tokens: int | None = Field(None, ge=1)
    seed: int | None = None
    stop: str | list[str] | list[int] | None = None
    temperature: float = Field(1.0, ge=0)
    top_k: int = -1
    top_p: float = Field(1.0, gt=0, le=1)


class SampleRequest(_Req):
    sampling_session_id: str | None = None
    base_model: str | None = None
    model_path: str | None = None
    seq_id: int | None = None
    num_samples: int = Field(1, ge=1, le=128)
    prompt: ModelInputWire
    sampling_params: SamplingParamsWire
    prompt_logprobs: bool = False
    topk_prompt_logprobs: int = Field(0, ge=0)
    topk_sample_logprobs: int = Field(0, ge=0)
    prompt_alt_tokens_k: int = Field(0, ge=0)
    prompt_logprobs_last_n: int | None = None
    target_prompt_logprobs: dict | None = None  # TensorData JSON (dense or sparse CSR)


class RetrieveFutureRequest(_Req):
    request_id: str
    allow_metadata_only: bool = False


class UntypedFuture(BaseModel):
    request_id: str
    model_id: str | None = None
    sample_sequence_ids: list[str] | None = None


# -- responses ---------------------------------------------------------------------------------
# Field order is the order the routes always sent; a route returning one of these is serialised
# through it (FastAPI), so a key the model lacks would be dropped: keep them complete.


class FutureResponse(BaseModel):
    """A submitted future of a model (SDK: UntypedAPIFuture)."""

    request_id: str
    model_id: str


class SampleFutureResponse(BaseModel):
    """A submitted sample future (SDK: UntypedAPIFuture with sample_sequence_ids)."""

    request_id: str
    sample_sequence_ids: list[str]


class ModelData(BaseModel):
    arch: str
    model_name: str
    tokenizer_id: str


class GetInfoResponse(BaseModel):
    type: Literal["get_info"]
    model_id: str
    model_data: ModelData
    model_name: str
    is_lora: bool
    lora_rank: int
    optimizer_config: dict[str, Any]


class CreateSamplingSessionResponse(BaseModel):
    sampling_session_id: str
    type: Literal["create_sampling_session"]


class GetSamplerResponse(BaseModel):
    sampler_id: str
    base_model: str
    model_path: str | None


class ExternalWeightsUrlsResponse(BaseModel):
    urls: dict[str, str]
    expires: str
