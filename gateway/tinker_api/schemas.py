"""Wire schemas of the Tinker JSON endpoints (requests and responses), as tinker 0.38.0 sends them.

Requests ignore unknown fields (newer SDKs add fields; refusing them would break old servers'
promise of "existing code runs unchanged"), but every known field is type-checked and a violation is
a 400 naming the field. Responses carry every field the SDK's strict response validation requires.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

from gateway.deps import MAX_TTL_S, SEED_MAX, SEED_MIN, Tags, UserMetadata


class WireRequest(BaseModel):
    """The base of every request body: unknown fields are ignored (see above)."""

    model_config = ConfigDict(extra="ignore")


class ClientConfigRequest(WireRequest):
    sdk_version: str | None = None


class CreateSessionRequest(WireRequest):
    tags: Tags = Field(default_factory=list)
    user_metadata: UserMetadata = None
    sdk_version: str | None = None
    # the columns' lengths (Postgres enforces them: a longer one would be a 500)
    project_id: str | None = Field(default=None, max_length=128)
    display_name: str | None = Field(default=None, max_length=256)


class SessionHeartbeatRequest(WireRequest):
    session_id: str


class FinishReason(WireRequest):
    type: str = "success"


class FinishSessionRequest(WireRequest):
    reason: FinishReason | None = None
    detail: str | None = None


class LoraConfigWire(WireRequest):
    rank: int = Field(default=32, ge=1)
    seed: int | None = Field(default=None, ge=SEED_MIN, le=SEED_MAX)
    train_unembed: bool = True
    train_mlp: bool = True
    train_attn: bool = True


class CreateModelRequest(WireRequest):
    session_id: str
    model_seq_id: int = Field(ge=0)
    base_model: str
    lora_config: LoraConfigWire = Field(default_factory=LoraConfigWire)
    user_metadata: UserMetadata = None
    optimizer_config: dict[str, Any] | None = None


class GetInfoRequest(WireRequest):
    model_id: str


class AdamParamsWire(WireRequest):
    learning_rate: float = Field(1e-4, ge=0)
    beta1: float = Field(0.9, ge=0, lt=1)
    beta2: float = Field(0.95, ge=0, lt=1)
    eps: float = Field(1e-12, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    grad_clip_norm: float = Field(0.0, ge=0)


class OptimStepRequest(WireRequest):
    model_id: str
    seq_id: int = Field(ge=1)
    adam_params: AdamParamsWire | None = None
    optimizer_params: dict[str, Any] | None = None


class SaveWeightsRequest(WireRequest):
    model_id: str
    seq_id: int = Field(ge=1)
    path: str | None = None
    overwrite: bool = False
    ttl_seconds: int | None = Field(None, ge=1, le=MAX_TTL_S)
    user_metadata: UserMetadata = None


class SaveWeightsForSamplerRequest(WireRequest):
    model_id: str
    seq_id: int = Field(ge=1)
    path: str | None = None
    sampling_session_seq_id: int | None = Field(None, ge=0)
    kind: str | None = None
    ttl_seconds: int | None = Field(None, ge=1, le=MAX_TTL_S)
    user_metadata: UserMetadata = None


class LoadWeightsRequest(WireRequest):
    path: str
    optimizer: bool = False
    # create-via-load
    session_id: str | None = None
    model_seq_id: int | None = Field(None, ge=0)
    base_model: str | None = None
    user_metadata: UserMetadata = None
    # legacy in-place load
    model_id: str | None = None
    seq_id: int | None = Field(None, ge=1)


class SaveWeightsExternalRequest(WireRequest):
    model_id: str
    path: str
    seq_id: int = Field(ge=1)
    ttl_seconds: int | None = Field(None, ge=1, le=MAX_TTL_S)
    age_encryption_recipients: list[str] | None = None


class CreateSamplingSessionRequest(WireRequest):
    session_id: str
    sampling_session_seq_id: int = Field(ge=0)
    base_model: str | None = None
    model_path: str | None = None


class EncodedTextChunkWire(WireRequest):
    type: Literal["encoded_text"] = "encoded_text"
    tokens: list[int]


class ModelInputWire(WireRequest):
    chunks: list[dict[str, Any]]


class SamplingParamsWire(WireRequest):
    max_tokens: int | None = Field(None, ge=1)
    seed: int | None = Field(default=None, ge=SEED_MIN, le=SEED_MAX)
    stop: str | list[str] | list[int] | None = None
    temperature: float = Field(1.0, ge=0)
    top_k: int = -1
    top_p: float = Field(1.0, gt=0, le=1)


class SampleRequest(WireRequest):
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
    #: record each returned sequence's stability info for stable_reinforce (None: false)
    record_stability_info: bool | None = None


class RetrieveFutureRequest(WireRequest):
    request_id: str
    allow_metadata_only: bool = False


# -- responses ---------------------------------------------------------------------------------
# A route declares its response with `returns(Model)`: the model documents it in OpenAPI (and the
# contract snapshot) and validates it. Handlers still build dicts (the native API calls some of
# them directly); only the keys a handler set are sent, in the model's field order, which is the
# order the handlers always used, so the bytes on the wire are what they were before the models.
# Field names are tinker 0.38's (tinker.types); the SDK's models are not imported, so the gateway
# does not depend on the SDK's private modules.


def returns(model: type[BaseModel]) -> dict[str, Any]:
    """Route decorator arguments for a response of type ``model``."""
    return {"response_model": model, "response_model_exclude_unset": True}


class FutureResponse(BaseModel):
    """A submitted future of a model (SDK: UntypedAPIFuture)."""

    request_id: str
    model_id: str


class SampleFutureResponse(BaseModel):
    """A submitted sample future (SDK: UntypedAPIFuture with sample_sequence_ids)."""

    request_id: str
    sample_sequence_ids: list[str]


class HealthResponse(BaseModel):
    status: str


class ClientConfigResponse(BaseModel):
    pjwt_auth_enabled: bool
    proto_compress_fwdbwd: bool
    sample_use_retrieve_futures: bool
    sample_join_sampling_session: bool
    custom_loss_server_side: bool


class ClientDynamicConfigResponse(BaseModel):
    refresh_interval_sec: int
    sample_cancel_enabled: bool


class CreateSessionResponse(BaseModel):
    session_id: str
    type: Literal["create_session"]
    #: sent only to a deprecated (warning) or unsupported (error) SDK version
    warning_message: str | None = None
    error_message: str | None = None


class SessionHeartbeatResponse(BaseModel):
    type: Literal["session_heartbeat"]


class FinishSessionResponse(BaseModel):
    status: str
    session_id: str


class TelemetryResponse(BaseModel):
    status: str


class SupportedModel(BaseModel):
    model_name: str
    max_context_length: int | None
    max_lora_rank: int
    trainable: bool
    sampleable: bool


class GetServerCapabilitiesResponse(BaseModel):
    supported_models: list[SupportedModel]


class ListSessionsResponse(BaseModel):
    sessions: list[str]


class GetSessionResponse(BaseModel):
    training_run_ids: list[str]
    sampler_ids: list[str]
    user_metadata: dict[str, str] | None
    display_name: str | None
    project_id: str | None
    status: Literal["active", "finished", "expired"]


class AssignProjectResponse(BaseModel):
    session_id: str
    project_id: str


class TraceExportResponse(BaseModel):
    status: Literal["pending", "ready", "failed"]
    url: str | None = None
    error: str | None = None


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


def _str_values(value: Any) -> Any:
    """The SDK's schema: ``dict[str, str]``. A checkpoint saved through the native API records
    numbers (``consumed_train_samples``); sent as they are, the SDK refuses the whole listing."""
    if isinstance(value, dict):
        return {str(k): v if isinstance(v, str) else json_text(v) for k, v in value.items()}
    return value


def json_text(value: Any) -> str:
    import json

    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return str(value)


#: user_metadata as the Tinker SDK types it (its values are strings)
StrMetadata = Annotated[dict[str, str] | None, BeforeValidator(_str_values)]


class Checkpoint(BaseModel):
    checkpoint_id: str
    checkpoint_type: str
    time: str | None
    tinker_path: str
    size_bytes: int | None
    public: bool
    user_metadata: StrMetadata
    expires_at: str | None


class TrainingRun(BaseModel):
    training_run_id: str
    base_model: str
    model_owner: str
    is_lora: bool
    corrupted: bool
    lora_rank: int
    last_request_time: str | None
    last_checkpoint: Checkpoint | None
    last_sampler_checkpoint: Checkpoint | None
    user_metadata: StrMetadata


class Cursor(BaseModel):
    offset: int
    limit: int
    total_count: int


class TrainingRunsResponse(BaseModel):
    training_runs: list[TrainingRun]
    cursor: Cursor


class CheckpointsListResponse(BaseModel):
    checkpoints: list[Checkpoint]
    cursor: Cursor


class DeleteCheckpointResponse(BaseModel):
    deleted: str


class WeightsInfoResponse(BaseModel):
    base_model: str
    is_lora: bool
    lora_rank: int
    train_unembed: bool
    train_mlp: bool
    train_attn: bool
    optimizer_config: dict[str, Any]


class CopyWeightsResponse(BaseModel):
    tinker_path: str


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
