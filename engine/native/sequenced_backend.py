"""A `TrainingBackend` over the Trainer it lives in, for the native models it hosts.

The native API runs the engine's own `MultiLoraTransformersModel` (engine/local/model.py), so a
remote script gets exactly the in-process class's semantics. Its compute goes through this
backend to the Trainer's public coroutines, so native work is ordered, fairly scheduled and
pooled like Tinker work: each adapter name of a native model is one Trainer adapter (the run
``{model_id}:{adapter_name}``, `engine.rules.native_run_id`) with its own seq_id sequence
(0 = creation), under the owner's tenant.

The model class is synchronous, so the host drives it on a worker thread; this backend hands each
call to the Trainer's event loop and waits for it (`asyncio.run_coroutine_threadsafe`). The loop
never waits for a worker, so this cannot deadlock; a call made on the loop's own thread would
(it would block the loop that has to run it), so it is refused (`ReentrantCallError`). The path
is drawn in engine/native/__init__.py.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from engine.backends.base import GradOp, TrainingBackend
from engine.errors import AdapterNotFoundError
from engine.protocol import (
    AdamParams,
    ForwardBackwardInput,
    ForwardBackwardOutput,
    LoraSpec,
    OptimStepOutput,
)
from engine.rules import native_run_id

if TYPE_CHECKING:
    from engine.trainer import Trainer

T = TypeVar("T")


class ReentrantCallError(RuntimeError):
    """A native model's compute was called on the Trainer's event-loop thread: waiting there for
    the loop to run it would block forever."""


class SequencedTrainerBackend(TrainingBackend):
    """The `TrainingBackend` of one hosted native model: each call is a sequenced Trainer call
    (its adapter's next seq_id), run on the Trainer's event loop and waited for here."""

    def __init__(
        self, trainer: Trainer, loop: asyncio.AbstractEventLoop, *, model_id: str, tenant: str
    ) -> None:
        self._trainer, self._loop = trainer, loop
        self.model_id, self.tenant = model_id, tenant
        self.vocab_size = trainer.backend.vocab_size
        self.max_lora_rank = trainer.backend.max_lora_rank
        #: a VL model's image handling (rows with images are expanded on this thread); or None
        self.vision = trainer.backend.vision
        self._next_seq: dict[str, int] = {}  # run id → next seq_id (present = created)
        self._specs: dict[str, LoraSpec] = {}

    def run_id(self, adapter_name: str) -> str:
        return native_run_id(self.model_id, adapter_name)

    @property
    def run_ids(self) -> list[str]:
        return list(self._next_seq)

    def _wait(self, call: Coroutine[Any, Any, T]) -> T:
        """Run a Trainer coroutine on the Trainer's loop and wait for it on this (worker) thread."""
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:  # no loop on this thread: a worker, as it should be
            running = None
        if running is self._loop:
            call.close()
            raise ReentrantCallError(
                f"native model {self.model_id}: its compute was called on the Trainer's event "
                "loop thread, which would wait for itself; drive the model from a worker thread "
                "(NativeModelHost does)"
            )
        return asyncio.run_coroutine_threadsafe(call, self._loop).result()

    def _seq(self, adapter_name: str) -> tuple[str, int]:
        rid = self.run_id(adapter_name)
        if rid not in self._next_seq:
            raise AdapterNotFoundError(f"adapter {adapter_name!r} is not in this model")
        seq = self._next_seq[rid]
        self._next_seq[rid] = seq + 1  # a failed request still advances the Trainer's sequence
        return rid, seq

    # -- lifecycle -----------------------------------------------------------------------------
    def create_adapter(self, adapter_id: str, spec: LoraSpec) -> None:
        rid = self.run_id(adapter_id)
        self._wait(self._trainer.create_adapter(rid, spec, self.tenant))
        self._next_seq[rid], self._specs[rid] = 1, spec

    def has_adapter(self, adapter_id: str) -> bool:
        return self.run_id(adapter_id) in self._next_seq

    def delete_adapter(self, adapter_id: str) -> None:
        rid = self.run_id(adapter_id)
        if self._next_seq.pop(rid, None) is not None:
            self._wait(self._trainer.delete_adapter(rid))
        self._specs.pop(rid, None)

    def adapter_spec(self, adapter_id: str) -> LoraSpec:
        try:
            return self._specs[self.run_id(adapter_id)]
        except KeyError:
            raise AdapterNotFoundError(f"adapter {adapter_id!r} is not in this model") from None

    # -- sequenced work ------------------------------------------------------------------------
    def forward_backward(self, adapter_id: str, inp: ForwardBackwardInput) -> ForwardBackwardOutput:
        rid, seq = self._seq(adapter_id)
        return self._wait(self._trainer.forward_backward(rid, seq, inp))

    def optim_step(self, adapter_id: str, params: AdamParams) -> OptimStepOutput:
        rid, seq = self._seq(adapter_id)
        return self._wait(self._trainer.optim_step(rid, seq, params))

    def save_state(
        self,
        adapter_id: str,
        directory: str,
        *,
        include_optimizer: bool,
        age_recipients: Sequence[str] = (),
    ) -> int:
        rid, seq = self._seq(adapter_id)
        return self._wait(
            self._trainer.save_state(rid, seq, directory, include_optimizer, tuple(age_recipients))
        )

    def load_state(self, adapter_id: str, directory: str, *, include_optimizer: bool) -> LoraSpec:
        rid = self.run_id(adapter_id)
        if rid in self._next_seq:
            rid, seq = self._seq(adapter_id)
            spec = self._wait(self._trainer.load_state(rid, seq, directory, include_optimizer))
        else:  # create-via-load: the run's seq 0
            load = self._trainer.load_state(rid, None, directory, include_optimizer, self.tenant)
            spec = self._wait(load)
            self._next_seq[rid] = 1
        self._specs[rid] = spec
        return spec

    def adapter_grad(self, adapter_id: str, op: GradOp) -> float | None:
        """The accumulated gradient's L2 norm ("norm") or dropping it ("zero"), in seq order."""
        rid, seq = self._seq(adapter_id)
        return self._wait(self._trainer.adapter_grad(rid, seq, op))
