"""The backend interfaces the engine's deployments drive.

A training backend holds one base model and many named adapters (one per Tinker training run);
a sampling backend generates from the base model or from a saved adapter directory. Methods are
synchronous and not thread-safe: the deployment serialises calls on one worker thread.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

from engine.errors import EngineError
from engine.protocol import (
    AdamParams,
    ForwardBackwardInput,
    ForwardBackwardOutput,
    LoraSpec,
    OptimStepOutput,
    SampleInput,
    SampleOutput,
)


class TrainingBackend(ABC):
    """One base model plus many adapters, each with its own optimizer state and step count."""

    #: number of rows of the embedding matrix; token ids must be in [0, vocab_size)
    vocab_size: int
    #: largest LoRA rank this backend accepts
    max_lora_rank: int

    @abstractmethod
    def create_adapter(self, adapter_id: str, spec: LoraSpec) -> None:
        """Add a fresh adapter (B = 0, A from ``spec.seed``): same seed, same init."""

    @abstractmethod
    def has_adapter(self, adapter_id: str) -> bool:
        """Whether the adapter is loaded."""

    @abstractmethod
    def delete_adapter(self, adapter_id: str) -> None:
        """Drop the adapter and its optimizer state (no-op if absent)."""

    @abstractmethod
    def adapter_spec(self, adapter_id: str) -> LoraSpec:
        """The spec the adapter was created or loaded with."""

    @abstractmethod
    def forward_backward(self, adapter_id: str, inp: ForwardBackwardInput) -> ForwardBackwardOutput:
        """Run the loss; unless ``inp.forward_only``, add its gradient to the adapter's
        accumulated gradient (summed until the next optim_step)."""

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

    def has_pending_grad(self, adapter_id: str) -> bool:
        """True between a non-forward_only forward_backward and the next optim_step (an adapter
        holding a gradient must not be evicted). Backends that accumulate gradients override it."""
        raise NotImplementedError(f"{type(self).__name__} does not track pending gradients")

    @abstractmethod
    def optim_step(self, adapter_id: str, params: AdamParams) -> OptimStepOutput:
        """Apply one AdamW step with the accumulated gradient, then clear it."""

    @abstractmethod
    def save_state(self, adapter_id: str, directory: str, *, include_optimizer: bool) -> int:
        """Write a PEFT-format checkpoint (plus optimizer state if asked) atomically to
        ``directory`` (which must not exist). Returns the total bytes written."""

    @abstractmethod
    def load_state(self, adapter_id: str, directory: str, *, include_optimizer: bool) -> LoraSpec:
        """Load a checkpoint into ``adapter_id`` (created from the checkpoint's config if absent)."""


class SamplingBackend(ABC):
    """Generates tokens from the base model or from adapter checkpoint directories."""

    vocab_size: int

    @abstractmethod
    def sample(self, inp: SampleInput) -> SampleOutput:
        """Generate ``inp.num_samples`` sequences for one prompt."""
