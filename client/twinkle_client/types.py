"""Response objects of the native protocol, with upstream Twinkle's names and attributes.

Pydantic models (``.model_dump()``, ``.model_dump_json()``), tolerant of fields a newer server adds
(``extra='allow'``). Model calls that return a value come back as ``{result: ...}`` and are read
as ``.result``; for code written against the in-process class, the result-bearing objects also
answer ``obj[key]`` / ``obj.get(key)`` / ``float(obj)`` from that result.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class _Wire(BaseModel):
    model_config = ConfigDict(extra="allow", protected_namespaces=())


# -- model calls -------------------------------------------------------------------------------
class _Result(_Wire):
    """``{result: ...}``; indexing and ``get`` reach into ``result`` (a dict)."""

    result: Any = None

    def __getitem__(self, key: Any) -> Any:
        return self.result[key]

    def get(self, key: Any, default: Any = None) -> Any:
        return self.result.get(key, default) if isinstance(self.result, dict) else default

    def __float__(self) -> float:
        return float(self.result)


class ForwardResponse(_Result):
    """``forward`` / ``forward_only``: the model output (``logps``/``logprobs``, ``loss``, ...)."""


class ForwardBackwardResponse(_Result):
    """``forward_backward``: the model output of the training pass."""


class CalculateLossResponse(_Result):
    pass


class ClipGradNormResponse(_Result):
    """``clip_grad_norm``: the gradient norm (upstream sends it as a string; ``float(r)``)."""


class CalculateMetricResponse(_Result):
    """``calculate_metric``: a dict of metric name → value."""


class GetTrainConfigsResponse(_Result):
    """``get_train_configs``: the adapter's training configuration."""


class GetStateDictResponse(_Result):
    pass


class TrainingProgressResponse(_Result):
    """``resume_from_checkpoint``: ``cur_step``, ``consumed_train_samples``, ..."""


class SaveResponse(_Wire):
    """``save``: the checkpoint's ``twinkle://`` path (``str(r)`` is that path)."""

    twinkle_path: str
    checkpoint_dir: str | None = None

    def __str__(self) -> str:
        return self.twinkle_path


class OkResponse(_Wire):
    status: str = "ok"


class AddAdapterResponse(_Wire):
    status: str = "ok"
    adapter_name: str | None = None


# -- sampler -----------------------------------------------------------------------------------
class SampledSequenceModel(_Wire):
    """One completion: ``logprobs[i]`` is ``[[token_id, logprob], ...]`` for position ``i``;
    ``new_input_feature`` is the prompt + completion as a training row."""

    stop_reason: str | None = None
    tokens: list[int] = Field(default_factory=list)
    logprobs: list[Any] | None = None
    decoded: str | None = None
    new_input_feature: dict[str, Any] | None = None

    @property
    def token_logprobs(self) -> list[float]:
        """The sampled tokens' log-probs (``logprobs[i][0][1]``)."""
        return [float(p[0][1]) if p else float("nan") for p in self.logprobs or []]


class SampleResponseModel(_Wire):
    sequences: list[SampledSequenceModel]
    prompt_logprobs: list[float | None] | None = None
    topk_prompt_logprobs: list[Any] | None = None


# -- management --------------------------------------------------------------------------------
class SupportedModel(_Wire):
    model_name: str


class GetServerCapabilitiesResponse(_Wire):
    supported_models: list[SupportedModel] = Field(default_factory=list)


class CapacityInfoResponse(_Wire):
    """Upstream's totals (``max_loras``, ``used_loras``, ``free_loras``); this server also
    sends per-model rows (``models``)."""

    max_loras: int | None = None
    used_loras: int | None = None
    free_loras: int | None = None
    models: list[dict[str, Any]] | None = None


class Cursor(_Wire):
    limit: int = 0
    offset: int = 0
    total_count: int = 0


class Checkpoint(_Wire):
    checkpoint_id: str
    checkpoint_type: str
    time: datetime
    size_bytes: int | None = None
    public: bool = False
    twinkle_path: str
    base_model: str | None = None
    is_lora: bool = True
    lora_rank: int | None = None
    user_metadata: dict[str, Any] | None = None


class TrainingRun(_Wire):
    training_run_id: str
    base_model: str
    model_owner: str
    save_dir: str | None = None
    is_lora: bool = True
    corrupted: bool = False
    lora_rank: int | None = None
    last_request_time: datetime | None = None
    last_checkpoint: dict[str, Any] | None = None
    last_sampler_checkpoint: dict[str, Any] | None = None
    user_metadata: dict[str, Any] | None = None


class ParsedCheckpointTwinklePath(_Wire):
    path: str
    twinkle_path: str
    training_run_id: str
    checkpoint_type: str
    checkpoint_id: str


class WeightsInfoResponse(_Wire):
    training_run_id: str
    base_model: str
    model_owner: str
    is_lora: bool = True
    lora_rank: int | None = None


class DeleteCheckpointResponse(_Wire):
    success: bool = True
    message: str = ""


__all__ = [
    "AddAdapterResponse",
    "CalculateLossResponse",
    "CalculateMetricResponse",
    "CapacityInfoResponse",
    "Checkpoint",
    "ClipGradNormResponse",
    "Cursor",
    "DeleteCheckpointResponse",
    "ForwardBackwardResponse",
    "ForwardResponse",
    "GetServerCapabilitiesResponse",
    "GetStateDictResponse",
    "GetTrainConfigsResponse",
    "OkResponse",
    "ParsedCheckpointTwinklePath",
    "SampleResponseModel",
    "SampledSequenceModel",
    "SaveResponse",
    "SupportedModel",
    "TrainingProgressResponse",
    "TrainingRun",
    "WeightsInfoResponse",
]
