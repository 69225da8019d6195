"""The adapter registry both torch training backends (Transformers, Megatron) are built on.

Owns `AdapterTable`: the ``adapter_id → TrainableAdapter`` table and every `TrainingBackend`
method that only reads or builds it (create, delete, lookups, the accumulated gradient's norm or
drop, the optimizer step, one request as a fused run of one). A backend says how to attach and
detach an adapter's LoRA weights on its model (`_attach`, `_detach`), how to check a spec
(`_check_spec`), how the gradient's global norm is summed (`_grad_norm`: one process, or shards
over tensor/pipeline ranks) and how a pass runs (`_prepare`, `_execute`).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn

from engine.backends.base import GradOp, check_grad_op
from engine.backends.train_common import (
    AdapterPass,
    TrainableAdapter,
    adam_step,
    check_adam,
    check_reload,
    new_optimizer,
    require_grad,
    run_fused,
)
from engine.errors import AdapterNotFoundError, CheckpointError, EngineError, UserInputError
from engine.protocol import (
    AdamParams,
    ForwardBackwardInput,
    ForwardBackwardOutput,
    LoraSpec,
    OptimStepOutput,
)


class AdapterTable:
    """Mixed into a torch training backend: its adapters and the methods that only use them."""

    device: torch.device
    _adapters: dict[str, TrainableAdapter]

    # -- what the backend provides ---------------------------------------------------------
    def _attach(self, adapter_id: str, spec: LoraSpec) -> dict[str, nn.Parameter]:
        """Add the adapter's LoRA weights to the model; its parameters by PEFT name, in order."""
        raise NotImplementedError

    def _detach(self, adapter_id: str) -> None:
        raise NotImplementedError

    def _check_spec(self, spec: LoraSpec, error: type[Exception]) -> None:
        """Raise ``error`` if this model cannot hold an adapter of ``spec``."""
        raise NotImplementedError

    def _grad_norm(self, st: TrainableAdapter, grads: Sequence[torch.Tensor | None]) -> float:
        """The float64 L2 norm of the adapter's whole gradient (None entries: no gradient)."""
        raise NotImplementedError

    def _prepare(self, slot: int, adapter_id: str, inp: ForwardBackwardInput) -> AdapterPass:
        raise NotImplementedError

    def _execute(self, jobs: list[AdapterPass], *, grad: bool) -> None:
        raise NotImplementedError

    # -- the table ---------------------------------------------------------------------------
    def _get(self, adapter_id: str) -> TrainableAdapter:
        try:
            return self._adapters[adapter_id]
        except KeyError:
            raise AdapterNotFoundError(f"adapter {adapter_id!r} is not loaded") from None

    def _create(self, adapter_id: str, spec: LoraSpec) -> TrainableAdapter:
        params = self._attach(adapter_id, spec)
        st = TrainableAdapter(spec=spec, params=params, optimizer=new_optimizer(params))
        self._adapters[adapter_id] = st
        return st

    def _for_load(
        self, adapter_id: str, spec: LoraSpec, path: Path
    ) -> tuple[TrainableAdapter, bool]:
        """The adapter a checkpoint of ``spec`` loads into, and whether it was created for it
        (the caller deletes it again if the load fails); an existing one must have the same
        shape (`check_reload`)."""
        if adapter_id not in self._adapters:
            self._check_spec(spec, CheckpointError)
            return self._create(adapter_id, spec), True
        st = self._adapters[adapter_id]
        check_reload(st, spec, adapter_id, path)
        return st, False

    def create_adapter(self, adapter_id: str, spec: LoraSpec) -> None:
        if not isinstance(adapter_id, str) or not adapter_id:
            raise UserInputError("adapter_id: must be a non-empty string")
        if adapter_id in self._adapters:
            raise UserInputError(
                f"adapter_id {adapter_id!r}: an adapter with this id exists already"
            )
        self._check_spec(spec, UserInputError)
        self._create(adapter_id, spec)

    def has_adapter(self, adapter_id: str) -> bool:
        return adapter_id in self._adapters

    def delete_adapter(self, adapter_id: str) -> None:
        if self._adapters.pop(adapter_id, None) is not None:
            self._detach(adapter_id)

    def adapter_spec(self, adapter_id: str) -> LoraSpec:
        return self._get(adapter_id).spec

    def has_pending_grad(self, adapter_id: str) -> bool:
        """True between a non-forward_only forward_backward and the next optim_step (False for an
        adapter that is not loaded: it holds no gradient here)."""
        st = self._adapters.get(adapter_id)
        return bool(st is not None and st.has_grad)

    def adapter_grad(self, adapter_id: str, op: GradOp) -> float | None:
        """The accumulated gradient's float64 L2 norm ("norm"), or drop it ("zero")."""
        check_grad_op(op)
        st = self._get(adapter_id)
        if op == "norm":
            return self._grad_norm(st, [p.grad for p in st.params.values()])
        for p in st.params.values():
            p.grad = None
        st.has_grad = False
        return None

    def optim_step(self, adapter_id: str, params: AdamParams) -> OptimStepOutput:
        st = self._get(adapter_id)
        check_adam(params)
        grads = require_grad(st)
        return adam_step(st, grads, self._grad_norm(st, grads), params)

    def synchronize(self) -> None:
        if self.device.type == "cuda":  # CUDA launches are asynchronous; CPU ops are not
            torch.cuda.synchronize(self.device)

    # -- passes --------------------------------------------------------------------------------
    def forward_backward(self, adapter_id: str, inp: ForwardBackwardInput) -> ForwardBackwardOutput:
        job = self._prepare(0, adapter_id, inp)
        self._execute([job], grad=not job.req.forward_only)
        return job.result()

    def forward_backward_many(
        self, items: Sequence[tuple[str, ForwardBackwardInput]]
    ) -> list[ForwardBackwardOutput | EngineError]:
        """Several adapters' requests in one fused pass. Each slot gets its output or its own
        EngineError (a bad item does not stop the others); a compute failure fails every item of
        its pass (training items, or forward_only items) and leaves their accumulated gradients
        as they were. Duplicate adapter ids raise ValueError."""
        return run_fused(items, self._prepare, self._execute)
