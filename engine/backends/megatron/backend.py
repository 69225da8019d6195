"""`MegatronTrainingBackend`: the Megatron backend as the Trainer sees it (backends/base.py).

One Trainer replica drives ``tensor_parallel × pipeline_parallel`` ranks. With one rank the
`MegatronWorker` lives in the replica's own process (megatron's CPU shims and process group
then belong to that process, which serves nothing else). With more, each rank is a Ray actor in
a STRICT_PACK placement group (one node: GPUs with nccl on a GPU host, CPUs with gloo here); the
actors rendezvous on rank 0's address and every public method fans out to all of them with the
same arguments (SPMD) and returns rank 0's result. A method travels as a typed call on the worker
(``lambda w: w.forward_backward(adapter_id, inp)``, pickled to each rank), so pyright checks it
against `MegatronWorker` as it checks the one-rank path. Ranks raise the same EngineError for the
same input (validation runs before any collective), so rank 0's error is every rank's error.

Everything above the backend (scheduler, fairness, adapter pool offload, futures, quotas,
checkpoints, samplers) works unchanged: this class implements the same contract as the
Transformers backend, including `forward_backward_many` (several tenants' rows in one pass),
`has_pending_grad` and `adapter_grad`.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from engine.backends.base import GradOp, TrainingBackend
from engine.backends.megatron import compat
from engine.backends.megatron.arch import read_arch
from engine.errors import BackendError, ConfigError, EngineError
from engine.protocol import (
    AdamParams,
    ForwardBackwardInput,
    ForwardBackwardOutput,
    LoraSpec,
    OptimStepOutput,
)

if TYPE_CHECKING:
    from engine.backends.megatron.worker import MegatronWorker

T = TypeVar("T")
#: a call on one rank's worker (its result is that rank's answer)
WorkerCall = Callable[["MegatronWorker"], T]

log = logging.getLogger(__name__)
#: how long the rank actors may wait for their placement group before the replica gives up
PLACEMENT_TIMEOUT_S = 120.0


class _RankActor:
    """One rank's process (a Ray actor): holds a `MegatronWorker` and runs its methods."""

    def __init__(self) -> None:
        self.worker: Any = None

    def address(self) -> tuple[str, int]:
        import ray

        with socket.socket() as s:  # a free port on this node, for the rendezvous
            s.bind(("", 0))
            port = s.getsockname()[1]
        return ray.util.get_node_ip_address(), port

    def start(self, model_dir: str, kwargs: dict) -> tuple[str, Any]:
        from engine.backends.megatron.worker import MegatronWorker

        return self._guard("start", lambda: MegatronWorker(model_dir, **kwargs), keep=True)

    def call(self, label: str, fn: WorkerCall[Any]) -> tuple[str, Any]:
        return self._guard(label, lambda: fn(self.worker))

    def _guard(self, name: str, fn, keep: bool = False) -> tuple[str, Any]:
        try:
            value = fn()
        except EngineError as e:
            return "err", e
        except Exception as e:  # a compute failure: report it, keep the actor
            log.exception("megatron rank: %s failed", name)
            return "err", BackendError(f"megatron {name} failed: {type(e).__name__}: {e}")
        if keep:
            self.worker = value
            return "ok", None
        return "ok", value


class MegatronTrainingBackend(TrainingBackend):
    """Many LoRA adapters over one frozen megatron-core GPTModel split over TP × PP ranks."""

    def __init__(
        self,
        model_dir: str,
        *,
        tensor_parallel: int = 1,
        pipeline_parallel: int = 1,
        max_lora_rank: int = 64,
        base_model_name: str = "",
        micro_batch_tokens: int = 16384,
        params_dtype: str = "float32",
        recompute: str = "none",
        worker_num_cpus: float = 1.0,
        worker_num_gpus: float = 0.0,
        loss_limits: Any = None,
    ) -> None:
        """``loss_limits``: a custom loss's budgets (engine/backends/custom_loss_run.LossLimits;
        None: its defaults)."""
        tp, pp = tensor_parallel, pipeline_parallel
        arch = read_arch(model_dir, tp=tp, pp=pp)  # config errors first, without megatron
        compat.require_megatron()
        self.vocab_size = arch.vocab_size
        self.max_positions = arch.max_positions
        self.max_lora_rank = int(max_lora_rank)
        self.world_size = tp * pp
        self._gpu = worker_num_gpus > 0
        kwargs = {
            "tp": tp,
            "pp": pp,
            "max_lora_rank": max_lora_rank,
            "base_model_name": base_model_name,
            "micro_batch_tokens": micro_batch_tokens,
            "params_dtype": params_dtype,
            "recompute": recompute,
            "loss_limits": loss_limits,
        }
        self._local: MegatronWorker | None = None
        self._actors: list[Any] = []
        self._pg: Any = None
        if self.world_size == 1:
            from engine.backends.megatron.worker import MegatronWorker

            self._local = MegatronWorker(model_dir, **kwargs)
        else:
            self._start_actors(model_dir, kwargs, worker_num_cpus, worker_num_gpus)

    # ------------------------------------------------------------------------------- ranks

    def _start_actors(self, model_dir: str, kwargs: dict, cpus: float, gpus: float) -> None:
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        bundle = {"CPU": float(cpus)} | ({"GPU": float(gpus)} if gpus else {})
        pg = placement_group([bundle] * self.world_size, strategy="STRICT_PACK")
        ready, _ = ray.wait([pg.ready()], timeout=PLACEMENT_TIMEOUT_S)
        if not ready:
            remove_placement_group(pg)
            raise ConfigError(
                f"megatron: {self.world_size} ranks x {bundle} could not be placed on one node "
                f"within {PLACEMENT_TIMEOUT_S:.0f}s (cluster resources: "
                f"{ray.available_resources()}); lower megatron.worker_num_cpus or the parallel "
                "sizes, or add a node"
            )
        self._pg = pg
        actor_cls = ray.remote(_RankActor)
        self._actors = [
            actor_cls.options(
                num_cpus=cpus,
                num_gpus=gpus,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=pg, placement_group_bundle_index=r
                ),
            ).remote()
            for r in range(self.world_size)
        ]
        addr, port = ray.get(self._actors[0].address.remote())
        starts = [
            a.start.remote(
                model_dir, kwargs | {"rank": r, "master_addr": addr, "master_port": port}
            )
            for r, a in enumerate(self._actors)
        ]
        for kind, value in ray.get(starts):
            if kind == "err":
                self.close()
                raise value

    def _ranks(self, label: str, fn: WorkerCall[T]) -> T:
        """``fn(worker)`` on every rank (SPMD); rank 0's result. ``label`` names the call in
        errors and logs."""
        if self._local is not None:
            return fn(self._local)
        import ray
        from ray.exceptions import RayError

        try:
            results = ray.get([a.call.remote(label, fn) for a in self._actors])
        except RayError as e:
            raise BackendError(f"megatron {label}: a rank died: {type(e).__name__}: {e}") from None
        kind, value = results[0]
        if kind == "err":
            raise value
        bad = next((v for k, v in results if k == "err"), None)
        if bad is not None:  # rank 0 finished but another rank failed: the replica is suspect
            raise bad
        return value

    def close(self) -> None:
        """Stop the rank actors and release their placement group (idempotent)."""
        if not self._actors and self._pg is None:
            return
        import ray
        from ray.util.placement_group import remove_placement_group

        for a in self._actors:
            ray.kill(a)
        self._actors = []
        if self._pg is not None:
            remove_placement_group(self._pg)
            self._pg = None

    # ------------------------------------------------------------------------------- contract

    def create_adapter(self, adapter_id: str, spec: LoraSpec) -> None:
        self._ranks("create_adapter", lambda w: w.create_adapter(adapter_id, spec))

    def has_adapter(self, adapter_id: str) -> bool:
        return bool(self._ranks("has_adapter", lambda w: w.has_adapter(adapter_id)))

    def delete_adapter(self, adapter_id: str) -> None:
        self._ranks("delete_adapter", lambda w: w.delete_adapter(adapter_id))

    def adapter_spec(self, adapter_id: str) -> LoraSpec:
        return self._ranks("adapter_spec", lambda w: w.adapter_spec(adapter_id))

    def validate_input(self, inp: ForwardBackwardInput) -> list[int]:
        return self._ranks("validate_input", lambda w: w.validate_input(inp))

    def forward_backward(self, adapter_id: str, inp: ForwardBackwardInput) -> ForwardBackwardOutput:
        return self._ranks("forward_backward", lambda w: w.forward_backward(adapter_id, inp))

    def forward_backward_many(
        self, items: Sequence[tuple[str, ForwardBackwardInput]]
    ) -> list[ForwardBackwardOutput | EngineError]:
        batch = list(items)
        return self._ranks("forward_backward_many", lambda w: w.forward_backward_many(batch))

    def synchronize(self) -> None:
        if self._gpu:
            self._ranks("synchronize", lambda w: w.synchronize())

    def device_fingerprint(self) -> dict:
        return self._ranks("device_fingerprint", lambda w: w.device_fingerprint())

    def has_pending_grad(self, adapter_id: str) -> bool:
        return bool(self._ranks("has_pending_grad", lambda w: w.has_pending_grad(adapter_id)))

    def adapter_grad(self, adapter_id: str, op: GradOp) -> float | None:
        return self._ranks("adapter_grad", lambda w: w.adapter_grad(adapter_id, op))

    def optim_step(self, adapter_id: str, params: AdamParams) -> OptimStepOutput:
        return self._ranks("optim_step", lambda w: w.optim_step(adapter_id, params))

    def save_state(
        self,
        adapter_id: str,
        directory: str,
        *,
        include_optimizer: bool,
        age_recipients: Sequence[str] = (),
    ) -> int:
        recipients = tuple(age_recipients)
        return int(
            self._ranks(
                "save_state",
                lambda w: w.save_state(
                    adapter_id,
                    directory,
                    include_optimizer=include_optimizer,
                    age_recipients=recipients,
                ),
            )
        )

    def load_state(self, adapter_id: str, directory: str, *, include_optimizer: bool) -> LoraSpec:
        return self._ranks(
            "load_state",
            lambda w: w.load_state(adapter_id, directory, include_optimizer=include_optimizer),
        )

    def export_adapter(self, adapter_id: str, *, grad: bool = False) -> dict:
        """Full PEFT tensors (or gradients) of an adapter as numpy: for tests and debugging."""
        return self._ranks("export_adapter", lambda w: w.export_adapter(adapter_id, grad=grad))
