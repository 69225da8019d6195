"""The Trainer: one base model, many tenants' adapters.

Per model, requests run in seq_id order; across tenants, compute is shared fairly by deficit
round robin over tokens (engine/scheduling/fair.py), with big forward_backward requests sliced so
that small tenants never wait behind a whole big batch (both in engine/adapter_steps.py);
adapters beyond the configured capacity are offloaded and reloaded transparently
(engine/scheduling/adapter_pool.py). The backend is built by name (engine/backends/registry.py)
and driven only through its contract (engine/backends/base.py).

Works in-process (tests, the local API) and as a Ray Serve deployment (engine/app.py): every
public method is a coroutine.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Awaitable, Callable, Sequence
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from engine.adapter_steps import AdapterSteps
from engine.backends.base import GradOp, TrainingBackend, check_grad_op
from engine.backends.registry import build_training_backend
from engine.config import ModelConfig
from engine.errors import BackendError, EngineError
from engine.native import NativeModelHost
from engine.protocol import (
    AdamParams,
    CustomLossGraph,
    ForwardBackwardInput,
    ForwardBackwardOutput,
    LoraSpec,
    OptimStepOutput,
    TrainerApi,
)
from engine.scheduling.adapter_pool import AdapterPool
from engine.scheduling.exactly_once import OnceCache
from engine.scheduling.execution_probe import probe_shape, stored_or_measured
from engine.scheduling.fair import FairScheduler
from engine.storage import SharedDirStorage
from engine.telemetry.exporter import ServesMetrics, export_replica_metrics
from engine.telemetry.metrics import ReplicaMetrics, State, measured

log = logging.getLogger(__name__)

T = TypeVar("T")


class Trainer(ServesMetrics):
    """One base model's training replica: many tenants' adapters on one `TrainingBackend`, built
    by name (engine/backends/registry.py) unless one is injected."""

    def __init__(
        self,
        model: ModelConfig | dict,
        data_dir: str,
        *,
        gap_timeout: float = 120.0,
        backend: TrainingBackend | None = None,
        telemetry: dict | None = None,
        storage_id: str | None = None,
    ) -> None:
        """``telemetry``: record Prometheus metrics (engine/telemetry/): ``{"replica": name,
        "host": address to serve them on, "export": False to only record}``; None: none.
        ``storage_id``: the checkpoint storage's id the driver wrote (engine/storage.py); this
        replica refuses to start on a node that does not reach that storage."""
        self.model = model if isinstance(model, ModelConfig) else ModelConfig.model_validate(model)
        self.storage = SharedDirStorage(data_dir)
        if storage_id is not None:
            self.storage.check(storage_id)  # before the minutes of loading a base model
        self._sched = FairScheduler(quantum=self.model.slice_tokens)
        # built and probed on the compute thread, which runs all the torch work of this process
        # (`FairScheduler.call_on_compute_thread` says why)
        self.backend = backend or self._sched.call_on_compute_thread(
            lambda: build_training_backend(self.model, data_dir)
        )
        offload = Path(data_dir) / "offload" / f"trainer-{os.getpid()}"
        self.pool = AdapterPool(self.backend, self.model.max_loaded_adapters, offload)
        self.execution = self._sched.call_on_compute_thread(self._choose_execution)
        self.steps = AdapterSteps(
            self.backend,
            self.pool,
            self._sched,
            self.storage,
            slice_tokens=self.model.slice_tokens,
            gap_timeout=gap_timeout,
        )
        # A repeated (model_id, seq_id) (a gateway replica re-driving a request after another
        # replica died) gets the first execution's result; see engine/scheduling/exactly_once.py.
        self._once = OnceCache()
        self.native = NativeModelHost(self, data_dir)
        self.metrics: ReplicaMetrics | None = None
        if telemetry is not None:
            self.metrics, self._exporter = export_replica_metrics(
                "trainer", self.model.name, data_dir, telemetry, self._telemetry_state
            )
            wait = self.metrics.queue_wait
            self._sched.on_start = lambda job: wait(time.monotonic() - job.enqueued)

    def _telemetry_state(self) -> State:
        """Read on the metrics scrape thread: plain reads, each atomic under the GIL."""
        depth, oldest = self._sched.backlog()
        pool = self.pool.stats()
        return State(
            queue_depth=depth,
            oldest_enqueued=oldest,
            adapters={"resident": pool["resident"], "offloaded": pool["offloaded"]},
            offloads=pool["evictions"],
            reloads=pool["reloads"],
            execution_mode=self.execution["mode"],
            counters={
                "twinkle_trainer_jobs": self._sched.completed,
                "twinkle_trainer_fused_batches": self._sched.fused_batches,
            },
            gauges={
                "twinkle_trainer_tenants": len(set(self.steps.tenants.values())),
                "twinkle_trainer_active_tenants": len(self._sched.queued_tenants()),
            },
        )

    # -- helpers -------------------------------------------------------------------------------
    def _run_fused(self, items: list[tuple[str, ForwardBackwardInput]]) -> list:
        """One result or error per item: an adapter that cannot be made resident (deleted, or
        its offloaded copy unreadable) fails its own item only."""
        results: list = [None] * len(items)
        ready = []
        for k, (adapter_id, _) in enumerate(items):
            try:
                self.pool.use(adapter_id)
            except EngineError as e:
                results[k] = e
            except Exception as e:  # an offload folder that cannot be read back
                log.exception("adapter %s could not be made resident", adapter_id)
                results[k] = BackendError(f"adapter {adapter_id!r}: {type(e).__name__}: {e}")
            else:
                ready.append(k)
        outs = self.backend.forward_backward_many([items[k] for k in ready]) if ready else []
        for k, out in zip(ready, outs, strict=True):
            results[k] = out
        return results

    def _choose_execution(self) -> dict:
        """fused or sequential: configured, or measured on this device at start-up."""
        mode = self.model.execution
        costs: dict = {}
        if mode == "auto":
            try:
                costs = stored_or_measured(self.backend, self._probe_shape(), self.storage.root)
                mode = costs["choice"]
            except Exception:  # a failed measurement must not stop the server
                log.exception("execution cost measurement failed; using sequential")
                mode = "sequential"
        if mode == "fused":
            self._sched.fuse_fn = self._run_fused
            self._sched.fuse_max_jobs = max(1, min(8, self.model.max_loaded_adapters))
        log.info("trainer %s: %s execution %s", self.model.name, mode, costs)
        return {"mode": mode, **costs}

    def _probe_shape(self) -> dict:
        return probe_shape(self.model, self.backend)

    async def check_custom_loss(self, graph: CustomLossGraph) -> None:
        """Check an uploaded custom loss graph (a UserInputError naming the node and the rule);
        the gateway stores it only if this passes. Needs no model, so any replica answers."""
        # imported here: it needs torch, and a Trainer on the mock backend runs without torch
        from engine.backends.custom_loss_graph import compile_loss

        compile_loss(graph)

    async def info(self) -> dict:
        return {
            "base_model": self.model.name,
            "vocab_size": self.backend.vocab_size,
            "max_lora_rank": self.backend.max_lora_rank,
            "max_context_length": self.backend.max_positions,
        }

    async def stats(self) -> dict:
        return {
            "pool": self.pool.stats(),
            "queued": self._sched.queued_tenants(),
            "completed": self._sched.completed,
            "fused_batches": self._sched.fused_batches,
            "execution": self.execution,
            # per tenant (the owner's user id): queued jobs, jobs ahead, oldest wait
            "queue": self._sched.queue_snapshot(),
            "adapters": [
                {"model_id": a, "tenant": self.steps.tenants.get(a, ""), "state": state}
                for a, state in self.pool.states().items()
            ],
        }

    async def status(self, model_id: str, seq_id: int) -> dict:
        """Where a pending request is, for `queue_state_reason`."""
        waiting_for = self.steps.seq.expected(model_id)
        reason = self._sched.describe(model_id)
        if reason is None and waiting_for is not None and waiting_for < seq_id:
            reason = f"waiting for seq_id {waiting_for} of this model to arrive"
        return {"queue_state": "active", "reason": reason or "in progress"}

    async def delete_adapter(self, model_id: str) -> None:
        await self.steps.delete(model_id)
        self._once.forget(model_id)

    # -- sequenced work ------------------------------------------------------------------------
    async def _forward_backward(
        self, model_id: str, seq_id: int, inp: ForwardBackwardInput
    ) -> ForwardBackwardOutput:
        out = await self.steps.forward_backward(model_id, seq_id, inp)
        if self.metrics is not None:
            kind = "forward" if inp.forward_only else "trained"
            self.metrics.tokens(kind, sum(len(d.tokens) for d in inp.data))
        return out

    async def adapter_grad(self, model_id: str, seq_id: int, op: GradOp) -> float | None:
        """In seq order, the adapter's accumulated gradient for the native API's clip_grad_norm
        / zero_grad: ``op`` "norm" → its L2 norm (0.0 without one), "zero" → drop it
        (`TrainingBackend.adapter_grad`). An unknown op is a UserInputError before sequencing."""
        check_grad_op(op)
        return await self.steps.grad(model_id, seq_id, op)

    async def _sequenced(
        self, op: str, key: tuple[str, int], call: Callable[[], Awaitable[T]]
    ) -> T:
        """``call()`` once per ``key`` (a repeat gets the first execution's result), its latency
        and failures recorded under ``op``."""
        return await measured(self.metrics, op, lambda: self._once.run(key, call))

    async def create_adapter(self, model_id: str, spec: LoraSpec, tenant: str = "") -> None:
        call = partial(self.steps.create, model_id, spec, tenant)
        return await self._sequenced("create_adapter", (model_id, 0), call)

    async def forward_backward(
        self, model_id: str, seq_id: int, inp: ForwardBackwardInput
    ) -> ForwardBackwardOutput:
        op = "forward" if inp.forward_only else "forward_backward"
        call = partial(self._forward_backward, model_id, seq_id, inp)
        return await self._sequenced(op, (model_id, seq_id), call)

    async def optim_step(self, model_id: str, seq_id: int, params: AdamParams) -> OptimStepOutput:
        call = partial(self.steps.optim_step, model_id, seq_id, params)
        return await self._sequenced("optim_step", (model_id, seq_id), call)

    async def skip(self, model_id: str, seq_id: int) -> None:
        """Let a request the gateway rejected pass the ordering (exactly once per seq_id)."""
        return await self._once.run((model_id, seq_id), partial(self.steps.skip, model_id, seq_id))

    async def save_state(
        self,
        model_id: str,
        seq_id: int,
        directory: str,
        include_optimizer: bool,
        age_recipients: Sequence[str] = (),
    ) -> int:
        """In seq order: write the adapter to ``directory``; with ``age_recipients``, as an
        age-encrypted export (`TrainingBackend.save_state`)."""
        call = partial(
            self.steps.save, model_id, seq_id, directory, include_optimizer, tuple(age_recipients)
        )
        return await self._sequenced("save_state", (model_id, seq_id), call)

    async def load_state(
        self,
        model_id: str,
        seq_id: int | None,
        directory: str,
        include_optimizer: bool,
        tenant: str = "",
    ) -> LoraSpec:
        key = (model_id, 0 if seq_id is None else seq_id)
        call = partial(self.steps.load, model_id, seq_id, directory, include_optimizer, tenant)
        return await self._sequenced("load_state", key, call)

    async def replays(self) -> int:
        """How many repeated (model_id, seq_id) calls were answered from the first execution."""
        return self._once.replays

    # -- native Twinkle API models: their state lives here (engine/native/host.py), their
    # ownership in the gateway; ``model_id`` comes first, so the gateway routes by it ----------
    async def native_create(self, model_id: str, tenant: str) -> dict:
        return await self.native.create(model_id, tenant)

    async def native_call(
        self, model_id: str, tenant: str, method: str, adapter_name: str, kwargs: dict
    ) -> Any:
        return await measured(
            self.metrics,
            "native",
            lambda: self.native.call(model_id, tenant, method, adapter_name, kwargs),
        )

    async def native_adapters(self, model_id: str, tenant: str) -> list[str]:
        return await self.native.adapters(model_id, tenant)

    async def native_close(self, model_id: str, tenant: str) -> None:
        return await self.native.close(model_id, tenant)


if TYPE_CHECKING:

    def _serves_the_gateway(replica: Trainer) -> TrainerApi:
        """Checked by pyright, never run: the Trainer has every method the gateway's typed client
        calls, with compatible parameters and results (engine.protocol.TrainerApi)."""
        return replica
