"""The Trainer's per-adapter work, each step in its model's seq_id order on the fair scheduler.

Owns: which tenant each adapter belongs to (the fair scheduler's unit of fairness), the seq_id
ordering of each adapter's requests (engine/scheduling/sequencer.py), slicing a big
forward_backward so small tenants never wait behind a whole big batch
(engine/scheduling/slicing.py), and the backend calls of creating, loading, training, saving and
deleting an adapter, with the adapter pool told which adapters are in use. Exactly-once answers
and metrics stay with the Trainer (engine/trainer.py), which drives this.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import TypeVar

from engine.backends.base import GradOp, TrainingBackend
from engine.protocol import (
    AdamParams,
    ForwardBackwardInput,
    ForwardBackwardOutput,
    LoraSpec,
    OptimStepOutput,
)
from engine.rules import CUSTOM_LOSS_FN
from engine.scheduling.adapter_pool import AdapterPool
from engine.scheduling.fair import FIXED_COST, FairScheduler
from engine.scheduling.sequencer import Sequencer
from engine.scheduling.slicing import datum_tokens, merge_outputs, slice_input
from engine.storage import SharedDirStorage

T = TypeVar("T")


class AdapterSteps:
    def __init__(
        self,
        backend: TrainingBackend,
        pool: AdapterPool,
        sched: FairScheduler,
        storage: SharedDirStorage,
        *,
        slice_tokens: int,
        gap_timeout: float,
    ) -> None:
        self.backend = backend
        self.pool = pool
        self.storage = storage
        self._sched = sched
        self._slice_tokens = slice_tokens
        self.seq = Sequencer(gap_timeout)
        #: adapter (model_id) -> its tenant; an adapter without one is its own tenant
        self.tenants: dict[str, str] = {}

    def tenant(self, model_id: str) -> str:
        return self.tenants.get(model_id, model_id)

    async def _compute(self, model_id: str, cost: int, fn, label: str, fuse_item=None):
        def job():
            self.pool.use(model_id)
            return fn()

        return await self._sched.run(self.tenant(model_id), model_id, cost, job, label, fuse_item)

    # -- lifecycle -----------------------------------------------------------------------------
    async def _start_model(
        self, model_id: str, tenant: str, build: Callable[[], T], label: str
    ) -> T:
        """A model's seq 0 (``build`` creates its adapter): afterwards its next request is seq 1."""
        self.tenants[model_id] = tenant or model_id

        def start() -> T:
            out = build()
            self.pool.added(model_id)
            return out

        out = await self._sched.run(self.tenants[model_id], model_id, FIXED_COST, start, label)
        self.seq.start(model_id, 1)
        return out

    async def create(self, model_id: str, spec: LoraSpec, tenant: str = "") -> None:
        create = partial(self.backend.create_adapter, model_id, spec)
        await self._start_model(model_id, tenant, create, "create")

    async def load(
        self,
        model_id: str,
        seq_id: int | None,
        directory: str,
        include_optimizer: bool,
        tenant: str = "",
    ) -> LoraSpec:
        """Create-via-load (``seq_id`` None: this is the model's seq 0) or an in-order load."""
        read = partial(self._read, model_id, directory, include_optimizer)
        if seq_id is None:
            return await self._start_model(model_id, tenant, read, "load")
        async with self.seq.turn(model_id, seq_id):
            return await self._compute(model_id, FIXED_COST, read, "load_state")

    def _read(self, model_id: str, directory: str, include_optimizer: bool) -> LoraSpec:
        readable = str(self.storage.readable(directory))
        return self.backend.load_state(model_id, readable, include_optimizer=include_optimizer)

    async def delete(self, model_id: str) -> None:
        def delete():
            self.backend.delete_adapter(model_id)
            self.pool.removed(model_id)

        await self._sched.run(self.tenant(model_id), model_id, FIXED_COST, delete, "delete")
        self.seq.forget(model_id)
        self.tenants.pop(model_id, None)

    # -- sequenced work ------------------------------------------------------------------------
    async def forward_backward(
        self, model_id: str, seq_id: int, inp: ForwardBackwardInput
    ) -> ForwardBackwardOutput:
        async with self.seq.turn(model_id, seq_id):
            return await self._forward_backward_slices(model_id, inp)

    async def _forward_backward_slices(
        self, model_id: str, inp: ForwardBackwardInput
    ) -> ForwardBackwardOutput:
        extra = None
        if inp.loss_fn == CUSTOM_LOSS_FN or sum(datum_tokens(inp)) > self._slice_tokens:
            # The whole request is checked before any slice adds to the gradient, on the compute
            # thread like any work (never on the event loop, where it would stall every tenant's
            # requests and health checks), and it says what a custom loss costs beyond tokens.
            extra = await self._compute(
                model_id, FIXED_COST, lambda: self.backend.validate_input(inp), "check"
            )
        slices = slice_input(inp, self._slice_tokens, extra)
        if len(slices) == 1:
            return await self._compute(
                model_id,
                slices[0][1],
                lambda: self.backend.forward_backward(model_id, inp),
                "forward" if inp.forward_only else "forward_backward",
                fuse_item=(model_id, inp),
            )
        outs = []
        for part, cost in slices:
            outs.append(
                await self._compute(
                    model_id,
                    cost,
                    lambda p=part: self.backend.forward_backward(model_id, p),
                    f"forward_backward slice {len(outs) + 1}/{len(slices)}",
                    fuse_item=(model_id, part),
                )
            )
        return merge_outputs(outs)

    async def optim_step(self, model_id: str, seq_id: int, params: AdamParams) -> OptimStepOutput:
        async with self.seq.turn(model_id, seq_id):
            return await self._compute(
                model_id,
                FIXED_COST,
                lambda: self.backend.optim_step(model_id, params),
                "optim_step",
            )

    async def save(
        self,
        model_id: str,
        seq_id: int,
        directory: str,
        include_optimizer: bool,
        age_recipients: Sequence[str],
    ) -> int:
        async with self.seq.turn(model_id, seq_id):
            return await self._compute(
                model_id,
                FIXED_COST,
                lambda: self._write(model_id, directory, include_optimizer, age_recipients),
                "save",
            )

    def _write(
        self, model_id: str, directory: str, include_optimizer: bool, age_recipients: Sequence[str]
    ) -> int:
        with self.storage.writable(directory) as local:
            return self.backend.save_state(
                model_id,
                str(local),
                include_optimizer=include_optimizer,
                age_recipients=age_recipients,
            )

    async def grad(self, model_id: str, seq_id: int, op: GradOp) -> float | None:
        async with self.seq.turn(model_id, seq_id):
            return await self._compute(
                model_id, FIXED_COST, lambda: self.backend.adapter_grad(model_id, op), f"grad_{op}"
            )

    async def skip(self, model_id: str, seq_id: int) -> None:
        """Let a request the gateway rejected pass the ordering, so later ones are not held up."""
        async with self.seq.turn(model_id, seq_id):
            pass
