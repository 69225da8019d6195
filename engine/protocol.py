"""Internal types exchanged between the gateway and the engine (and engine ↔ backends).

These are neither wire schemas (the gateway owns those) nor DB rows. Plain dataclasses, so they
pickle cheaply across Ray processes. Array fields hold numpy arrays; shapes are in the names' docs.

Types only: the rules both sides apply to them (LoRA configs, loss names, native model names and
routing) are in `engine.rules`. The facade protocols at the end (`TrainerApi`, `SamplerApi`) are the
method sets of the Trainer and Sampler deployments as the gateway calls them: the deployments
satisfy them and the gateway's typed clients (gateway/engine_client/) implement them, so pyright
checks both sides of the seam.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import numpy as np

#: Tinker's documented AdamParams defaults (tinker/types/optim_step_request.py).
DEFAULT_LR = 1e-4
#: LoRA alpha used when the client does not choose one (Tinker's wire format has no alpha field).
DEFAULT_LORA_ALPHA = 32.0
#: the seeds a LoRA init (and a sampler) takes: signed 64-bit (inside torch generators' range)
SEED_RANGE = (-(2**63), 2**63 - 1)


@dataclass(frozen=True)
class LoraSpec:
    """Configuration of one adapter. Target modules follow Tinker's three switches:
    train_attn → q/k/v/o projections, train_mlp → gate/up/down projections,
    train_unembed → lm_head; plus ``train_vision`` (off by default, vision-language models only):
    the vision tower's block projections too (VISION_TARGETS)."""

    rank: int
    alpha: float = DEFAULT_LORA_ALPHA
    train_attn: bool = True
    train_mlp: bool = True
    train_unembed: bool = True
    seed: int = 0
    train_vision: bool = False


@dataclass(frozen=True)
class ImagePart:
    """One image of a model input (a Tinker ``ImageChunk``): its encoded bytes, declared format
    (png | jpeg), the index into the text ``tokens`` where its image tokens go, the client's
    ``expected_tokens`` (None: not given) and the chunk's index in the client's chunk list (for
    error messages). The engine decodes and expands it (engine/backends/vision.py)."""

    data: bytes
    format: str
    position: int
    expected_tokens: int | None = None
    chunk_index: int = 0


@dataclass
class DatumInput:
    """One training example. ``tokens`` is the model input (length N). ``loss_fn_inputs`` maps names
    to arrays whose first dimension is N: ``target_tokens`` int64 [N] (or [N, K]), ``weights``
    float32 [N] (or [N, K]), and, for RL losses, ``logprobs`` / ``advantages`` float32 [N].
    Embedding losses (`EMBEDDING_LOSS_FNS`) take no targets: ``anchor`` float32 [1] (1 = this row
    is an anchor and starts a group, 0 = the positive / a negative of the current group).

    With ``images`` (VL models), ``tokens`` holds only the text tokens and N counts each image's
    tokens too (as Tinker's ``ModelInput.length`` does). Upstream Twinkle sends images already
    expanded into ``tokens`` with ``pixel_values`` / ``image_grid_thw`` in ``loss_fn_inputs``."""

    tokens: list[int]
    loss_fn_inputs: dict[str, np.ndarray]
    images: list[ImagePart] = field(default_factory=list)


@dataclass(frozen=True)
class CustomLossGraph:
    """A traced custom loss as the Tinker SDK uploads it (``create_custom_loss``): ``inputs`` are
    (name, rank) pairs, ``logprobs`` first; ``nodes`` the torch.fx nodes as plain JSON data
    (``{"op", "name", "target", "args", "kwargs"}``). Checked and run by
    engine/backends/custom_loss_graph.py; the gateway stores it per session."""

    name: str
    inputs: tuple[tuple[str, int], ...]
    nodes: tuple[dict[str, Any], ...]


@dataclass
class ForwardBackwardInput:
    data: list[DatumInput]
    loss_fn: str = "cross_entropy"
    loss_fn_config: dict[str, float | str] = field(default_factory=dict)
    forward_only: bool = False
    #: the graph of ``loss_fn == CUSTOM_LOSS_FN`` (the gateway attaches it by ``loss_id``)
    custom_loss: CustomLossGraph | None = None


@dataclass
class ForwardBackwardOutput:
    """``outputs[i]`` belongs to ``data[i]``: ``logprobs`` float32 [N] (learner log p of targets),
    ``elementwise_loss`` float32 [N] where the loss is per token (not DPO); for an embedding loss
    ``embedding`` float32 [H] (the pooled, L2-normalised sentence embedding) instead. ``metrics``
    keys are ``name:reduction`` (always ``loss:sum``)."""

    outputs: list[dict[str, np.ndarray]]
    metrics: dict[str, float]


@dataclass
class AdamParams:
    """All fields are honoured. ``grad_clip_norm`` 0 disables clipping; weight decay is
    decoupled."""

    learning_rate: float = DEFAULT_LR
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0


@dataclass
class OptimStepOutput:
    metrics: dict[str, float]


@dataclass
class SamplingParams:
    """``temperature`` 0 means greedy. ``top_k`` -1 and ``top_p`` 1 mean off. ``stop_strings`` and
    ``stop_token_ids`` end a sequence (the stop text/token is kept in the output, as Tinker does for
    token ids). ``stop_at_eos`` is False only when the client sent an explicit empty stop list."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop_strings: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    stop_at_eos: bool = True


@dataclass
class SampleInput:
    """``adapter_dir`` is a checkpoint directory (PEFT files) or None for the base model."""

    prompt_tokens: list[int]
    num_samples: int = 1
    params: SamplingParams = field(default_factory=SamplingParams)
    #: images of the prompt (VL models; positions index ``prompt_tokens``, text tokens only)
    prompt_images: list[ImagePart] = field(default_factory=list)
    prompt_logprobs: bool = False
    #: top-k most likely tokens with logprobs at every prompt position / every sampled position
    topk_prompt_logprobs: int = 0
    adapter_dir: str | None = None
    topk_sample_logprobs: int = 0
    #: score only the last N prompt tokens (earlier prompt logprobs are NaN, top-k rows empty)
    prompt_logprobs_last_n: int | None = None
    #: draws per prompt position (after the first) from the next-token distribution
    prompt_alt_tokens_k: int = 0
    #: int64 [len(prompt) - 1, K]: row i names token ids to score at prompt position i + 1;
    #: -1 = none
    target_prompt_ids: np.ndarray | None = None


#: the empty cell of a top-k matrix (Tinker's sentinel: token 0 with this logprob)
TOPK_MASK_LOGPROB = -99999.0


@dataclass
class TopkLogprobs:
    """``token_ids`` int32 and ``logprobs`` float32, both ``[length, k]``, most likely first;
    empty cells are (0, `TOPK_MASK_LOGPROB`)."""

    token_ids: np.ndarray
    logprobs: np.ndarray


@dataclass
class SampledSequence:
    tokens: list[int]
    logprobs: list[float]
    stop_reason: Literal["stop", "length"]
    topk: TopkLogprobs | None = None  # one row per token, when topk_sample_logprobs > 0


@dataclass
class SampleOutput:
    """``prompt_logprobs`` has len(prompt) values, NaN at position 0 (nothing predicts it) and
    before the last ``prompt_logprobs_last_n`` tokens; ``topk_prompt`` has len(prompt) rows, the
    same rows empty."""

    sequences: list[SampledSequence]
    prompt_logprobs: list[float] | None = None
    topk_prompt: TopkLogprobs | None = None
    #: ([len(prompt) - 1, k] int64 tokens, float32 logprobs) for ``prompt_alt_tokens_k``
    prompt_alt_tokens: tuple[np.ndarray, np.ndarray] | None = None
    #: float32, the shape of ``target_prompt_ids``; 0.0 where it had -1
    target_prompt_logprobs: np.ndarray | None = None


@dataclass
class SampleDelta:
    """A piece of a streamed sample (`Sampler.sample_stream`): new tokens and their logprobs per
    sample index, or, in the last delta, ``final``: the whole output (which supersedes them)."""

    tokens: dict[int, list[int]] = field(default_factory=dict)
    logprobs: dict[int, list[float]] = field(default_factory=dict)
    final: SampleOutput | None = None


# -- the deployments' method sets, as the gateway calls them -----------------------------------
# Every argument after a model id is keyword-only here: the Trainer's positional parameters
# satisfy that, and the gateway's calls cannot swap two ints (seq_id, tenant) unnoticed.


class ReplicaApi(Protocol):
    """What every Trainer and Sampler replica answers on its own (admin views, readiness)."""

    async def info(self) -> dict[str, Any]: ...

    async def stats(self) -> dict[str, Any]: ...


class TrainerApi(ReplicaApi, Protocol):
    """`engine.trainer.Trainer` as the gateway calls it (gateway/engine_client/facades.py).
    ``seq_id`` orders a model's requests (0 is its creation); ``tenant`` is the owner's user id,
    the fair scheduler's key."""

    async def check_custom_loss(self, graph: CustomLossGraph) -> None: ...

    async def status(self, model_id: str, *, seq_id: int) -> dict[str, Any]: ...

    async def create_adapter(self, model_id: str, *, spec: LoraSpec, tenant: str = "") -> None: ...

    async def forward_backward(
        self, model_id: str, *, seq_id: int, inp: ForwardBackwardInput
    ) -> ForwardBackwardOutput: ...

    async def optim_step(
        self, model_id: str, *, seq_id: int, params: AdamParams
    ) -> OptimStepOutput: ...

    async def skip(self, model_id: str, *, seq_id: int) -> None: ...

    async def save_state(
        self,
        model_id: str,
        *,
        seq_id: int,
        directory: str,
        include_optimizer: bool,
        age_recipients: Sequence[str] = (),
    ) -> int: ...

    async def load_state(
        self,
        model_id: str,
        *,
        seq_id: int | None,
        directory: str,
        include_optimizer: bool,
        tenant: str = "",
    ) -> LoraSpec: ...

    async def delete_adapter(self, model_id: str) -> None: ...

    async def native_create(self, model_id: str, *, tenant: str) -> dict[str, Any]: ...

    async def native_call(
        self, model_id: str, *, tenant: str, method: str, adapter_name: str, kwargs: dict
    ) -> Any: ...

    async def native_adapters(self, model_id: str, *, tenant: str) -> list[str]: ...

    async def native_close(self, model_id: str, *, tenant: str) -> None: ...


class SamplerApi(ReplicaApi, Protocol):
    """`engine.sampler.Sampler` as the gateway calls it: sampling, and the tokenizer and chat
    template of the model (engine/sampler_text.py), the one source of both for every dialect."""

    async def sample(self, inp: SampleInput) -> SampleOutput: ...

    def sample_stream(self, inp: SampleInput) -> AsyncIterator[SampleDelta]: ...

    async def encode_chat(
        self, messages: list[dict], *, add_generation_prompt: bool = True
    ) -> list[int]: ...

    async def encode_chat_images(
        self, messages: list[dict], *, image_fields: list[str], add_generation_prompt: bool = True
    ) -> tuple[list[int], list[int]]: ...

    async def encode_text(self, text: str) -> list[int]: ...

    async def decode(self, tokens: list[int]) -> str: ...

    async def decode_pieces(self, tokens: list[int]) -> list[str]: ...

    async def eos_token(self) -> str | None: ...

    async def image_token_id(self) -> int | None: ...

    async def encode_trajectory(
        self,
        messages: list[dict],
        *,
        add_generation_prompt: bool = False,
        options: Mapping[str, Any] | None = None,
        field: str = "inputs[0]",
    ) -> dict[str, list[int]]: ...

    async def tokenizer_files(self) -> dict[str, int]: ...

    async def tokenizer_file(self, name: str) -> bytes: ...
