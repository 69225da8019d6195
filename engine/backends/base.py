"""The backend contracts: everything the engine calls on a compute backend, and nothing else.

Three layers, each talking only to the one below::

    gateway (FastAPI: Tinker / native / OpenAI / admin routes, DB, quotas, futures)
       │  engine.protocol types, through its one engine-client module (Ray handles or in-process)
       ▼
    engine (Trainer, Sampler, scheduling/: sequencer, fair DRR, adapter pool, execution probe;
       │   local/: the in-process native model API)
       │  only the methods and attributes declared here
       ▼
    backends (TrainingBackend: transformers | megatron | mock;
              SamplingBackend: torch | vllm | mock — built by name in backends/registry.py)

The engine never probes a backend (no ``getattr``/``inspect``) and never reaches into its
model: a need the engine has becomes a method here, abstract when every backend must implement
it, with a documented default when one behaviour is right for backends that lack the feature.
Backends never import the gateway, FastAPI, Ray Serve or the DB.

Methods are synchronous and not thread-safe: the Trainer and the Sampler serialise all calls of
one backend on one worker thread. Errors a caller can act on are `EngineError`s
(engine/errors.py): `UserInputError` naming the field for bad input, `AdapterNotFoundError` for an
unknown adapter id, `CheckpointError` for a bad or missing checkpoint directory.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any, Literal

from engine.errors import BackendError, EngineError, UserInputError
from engine.protocol import (
    AdamParams,
    ForwardBackwardInput,
    ForwardBackwardOutput,
    LoraSpec,
    OptimStepOutput,
    SampleInput,
    SampleOutput,
)

#: ``listener(sample_index, token, logprob)``: called on the sampling thread per generated token
TokenListener = Callable[[int, int, float], None]
#: what `TrainingBackend.adapter_grad` can do with an adapter's accumulated gradient
GradOp = Literal["norm", "zero"]
GRAD_OPS: tuple[str, ...] = ("norm", "zero")


class TrainingBackend(ABC):
    """One base model plus many adapters, each with its own optimizer state and step count.

    Guarantees: gradients accumulate (sum) per adapter across `forward_backward` calls until
    `optim_step`; adapters never share state; the same seeds and inputs give the same numbers.
    """

    #: number of rows of the embedding matrix; token ids must be in [0, vocab_size)
    vocab_size: int
    #: largest LoRA rank this backend accepts
    max_lora_rank: int
    #: longest input (tokens) the model accepts, advertised as the context length; None: no
    #: known limit (the Trainer then probes with 128-token rows and advertises nothing)
    max_positions: int | None = None
    #: a vision-language model's image handling (engine/backends/vision.Vision: processes the
    #: images of native rows); None: a text model, which refuses images naming the field
    vision: Any = None

    # -- adapters ------------------------------------------------------------------------------
    @abstractmethod
    def create_adapter(self, adapter_id: str, spec: LoraSpec) -> None:
        """Add a fresh adapter (B = 0, A from ``spec.seed``): same seed, same init. A spec this
        backend cannot hold (rank, alpha, no target) or an existing id is a UserInputError."""

    @abstractmethod
    def has_adapter(self, adapter_id: str) -> bool:
        """Whether the adapter is loaded."""

    @abstractmethod
    def delete_adapter(self, adapter_id: str) -> None:
        """Drop the adapter, its gradient and its optimizer state (no-op if absent)."""

    @abstractmethod
    def adapter_spec(self, adapter_id: str) -> LoraSpec:
        """The spec the adapter was created or loaded with (AdapterNotFoundError if absent)."""

    # -- passes --------------------------------------------------------------------------------
    def validate_input(self, inp: ForwardBackwardInput) -> Sequence[int] | None:
        """Raise the UserInputError ``inp`` would fail with, computing nothing; return each
        datum's loss cost in tokens beyond its own tokens (a custom loss's work and memory,
        which the Trainer charges the tenant and slices by), or None for none. The Trainer calls
        it before running a large request in slices, so that a bad last slice cannot leave the
        earlier slices' gradients behind, and before any custom-loss request. Default: no check
        (forward_backward still validates; a backend whose forward_backward can reject input
        must override this)."""
        return None  # the documented default

    @abstractmethod
    def forward_backward(self, adapter_id: str, inp: ForwardBackwardInput) -> ForwardBackwardOutput:
        """Run the loss; unless ``inp.forward_only``, add its gradient to the adapter's
        accumulated gradient (summed until the next optim_step). ``outputs[i]`` belongs to
        ``inp.data[i]`` (at least ``logprobs``), ``metrics`` has ``loss:sum``. A rejected
        request changes nothing."""

    def forward_backward_many(
        self, items: Sequence[tuple[str, ForwardBackwardInput]]
    ) -> list[ForwardBackwardOutput | EngineError]:
        """Several adapters' requests at once (at most one item per adapter id, else ValueError).
        Slot i gets item i's output or its EngineError; a failing item does not stop the others.
        Results equal separate `forward_backward` calls. This default runs them one by one;
        backends that can fuse them into one batch override it."""
        ids = [aid for aid, _ in items]
        if len(set(ids)) != len(ids):
            dup = next(a for a in ids if ids.count(a) > 1)
            raise ValueError(f"forward_backward_many: adapter {dup!r} appears more than once")
        results: list[ForwardBackwardOutput | EngineError] = []
        for aid, inp in items:
            try:
                results.append(self.forward_backward(aid, inp))
            except EngineError as e:
                results.append(e)
        return results

    def synchronize(self) -> None:
        """Wait until queued device work is done (CUDA launches return early), so a wall-clock
        timing covers the work. Default: nothing to wait for (synchronous CPU backends)."""
        return None  # the documented default

    def device_fingerprint(self) -> dict[str, Any] | None:
        """What a timing on this backend depends on: the device (kind, name, threads), the
        numerics (dtype), the library versions and the model's architecture; JSON-able. The
        Trainer stores its start-up execution measurement under it
        (engine/scheduling/probe_cache.py), so a restart on the same kind of host skips the
        measurement. Default: None, nothing known, so every start measures."""
        return None  # the documented default

    # -- gradients and optimizer ---------------------------------------------------------------
    def has_pending_grad(self, adapter_id: str) -> bool:
        """True between a non-forward_only forward_backward and the next optim_step (or
        ``adapter_grad(..., "zero")``); False for an adapter that is not loaded. The adapter
        pool never evicts an adapter holding a gradient. Backends that accumulate override it."""
        raise NotImplementedError(f"{type(self).__name__} does not track pending gradients")

    def adapter_grad(self, adapter_id: str, op: GradOp) -> float | None:
        """The native API's clip_grad_norm / zero_grad on the accumulated gradient: ``"norm"``
        returns its L2 norm (summed in float64; 0.0 without one), ``"zero"`` drops it (then
        `has_pending_grad` is False and optim_step needs a new forward_backward) and returns None.
        Any other op is a UserInputError. Default, for backends that expose no gradients:
        ``"norm"`` → None (unknown), ``"zero"`` → BackendError."""
        check_grad_op(op)
        if op == "zero":
            raise BackendError(f"{type(self).__name__} cannot drop accumulated gradients")
        return None

    @abstractmethod
    def optim_step(self, adapter_id: str, params: AdamParams) -> OptimStepOutput:
        """Apply one AdamW step with the accumulated gradient, then clear it. Metrics include
        ``grad_norm`` (before clipping), ``learning_rate`` and ``step``. No gradient since the
        last step is a UserInputError."""

    # -- checkpoints ---------------------------------------------------------------------------
    @abstractmethod
    def save_state(
        self,
        adapter_id: str,
        directory: str,
        *,
        include_optimizer: bool,
        age_recipients: Sequence[str] = (),
    ) -> int:
        """Write a PEFT-format checkpoint (plus optimizer state if asked) atomically to
        ``directory`` (which must not exist: CheckpointError). Returns the total bytes written.
        A pending gradient is not saved. With ``age_recipients`` every file but the manifest is
        encrypted to them in memory before it is written, named ``<file>.age``
        (engine/backends/age_seal.py): an encrypted export, which nothing here loads again."""

    @abstractmethod
    def load_state(self, adapter_id: str, directory: str, *, include_optimizer: bool) -> LoraSpec:
        """Load a checkpoint into ``adapter_id`` (created from the checkpoint's config if absent);
        drops any pending gradient. Without ``include_optimizer`` the optimizer (and its step
        count) restarts. A bad checkpoint is a CheckpointError and leaves the adapter as it was."""


def check_grad_op(op: Any) -> None:
    """UserInputError unless ``op`` is one of `GRAD_OPS`."""
    if op not in GRAD_OPS:
        raise UserInputError(f"adapter_grad: unknown op {op!r} (known: {', '.join(GRAD_OPS)})")


class SamplingBackend(ABC):
    """Generates tokens from the base model or from adapter checkpoint directories.

    Guarantees: a request with a seed gives the same tokens alone or in any batch; a checkpoint
    directory rewritten in place is reloaded (never stale weights); a missing or bad checkpoint
    fails only the requests that name it.
    """

    #: number of token ids the model can emit; prompt ids must be in [0, vocab_size)
    vocab_size: int
    #: longest prompt + generation in tokens; None: no known limit
    max_positions: int | None = None
    #: a Hugging Face-style tokenizer (encode, decode, apply_chat_template, chat_template,
    #: eos_token) for the Sampler's text helpers (OpenAI-compatible API); None: token ids only
    tokenizer: Any = None

    @abstractmethod
    def sample(self, inp: SampleInput) -> SampleOutput:
        """Generate ``inp.num_samples`` sequences for one prompt (raises its EngineError)."""

    def sample_many(
        self,
        inputs: Sequence[SampleInput],
        listeners: Sequence[TokenListener | None] | None = None,
    ) -> list[SampleOutput | EngineError]:
        """All ``inputs`` (any adapters and params) at once. Slot i gets input i's output (equal
        to ``sample(inputs[i])``) or the EngineError that input alone raised. ``listeners[i]``,
        when given, is called with (sample index, token, logprob) per token of input i as it is
        generated; a backend that cannot stream ignores it (the stream then carries only the
        final output). Unexpected failures of the whole batch raise. This default runs `sample`
        one by one and never streams; backends that decode a batch together override it."""
        results: list[SampleOutput | EngineError] = []
        for inp in inputs:
            try:
                results.append(self.sample(inp))
            except EngineError as e:
                results.append(e)
        return results

    def adapter_cache_stats(self) -> dict[str, int]:
        """Counts of the adapter-directory cache (``loaded``, ``loads``, ``evictions``) for the
        Sampler's metrics; empty for a backend without one. Read on the metrics thread."""
        return {}

    def image_token_id(self) -> int | None:
        """A vision-language model's image token (what its chat template renders per image
        part, e.g. Qwen2-VL's ``<|image_pad|>``), for a backend that samples images; None (the
        default): this backend takes no images, and the Sampler refuses them naming the field."""
        return None

    def close(self) -> None:
        """Release what outlives garbage collection (engine processes, device memory); the
        backend is unusable afterwards. Idempotent. Default: nothing to release."""
        return None  # the documented default
