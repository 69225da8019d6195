"""Optimizer methods of `engine.local.model.MultiLoraTransformersModel` (a mixin): clip_grad_norm,
step, zero_grad, lr_step and clip_grad_and_step, over the adapter's accumulation window
(`engine.local.adapter_state.AdapterTraining`): the optimizer runs on every
``gradient_accumulation_steps``-th `step`; inside a window `zero_grad` and `lr_step` are no-ops,
as upstream Twinkle's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.errors import UserInputError
from engine.local.adapter_state import AdapterTraining
from engine.local.model_checkpoints import DEFAULT_ADAPTER
from engine.local.training_config import check_clip
from engine.protocol import AdamParams

if TYPE_CHECKING:
    from engine.backends.base import TrainingBackend


class OptimizerMethods:
    """Needs ``backend`` and ``_st`` of the model class."""

    backend: TrainingBackend

    def _st(self, adapter_name: str) -> AdapterTraining:  # pragma: no cover - the model's
        raise NotImplementedError

    def clip_grad_norm(
        self,
        max_grad_norm: float = 1.0,
        norm_type: float = 2,
        *,
        adapter_name: str = DEFAULT_ADAPTER,
    ) -> float | None:
        """Clip the accumulated gradient to ``max_grad_norm`` at the next applied step (0 = off).
        Returns the current unclipped L2 norm (0.0 without a gradient; None if unavailable)."""
        st = self._st(adapter_name)
        st.clip = check_clip(max_grad_norm, norm_type)
        if not st.pending_grad:
            return 0.0
        return self.backend.adapter_grad(adapter_name, "norm")

    def step(self, *, adapter_name: str = DEFAULT_ADAPTER) -> dict[str, float] | None:
        """Count one step; every ``gradient_accumulation_steps``-th call runs AdamW with lr =
        base lr × schedule multiplier and returns its metrics (grad_norm, learning_rate, step).
        Returns None while the accumulation window is open."""
        st = self._st(adapter_name)
        st.micro += 1
        if st.micro < st.gas:
            return None
        st.micro = 0
        if not st.pending_grad:
            raise UserInputError(
                "step: no gradient accumulated since the last step; call forward_backward first"
            )
        o = st.optim
        params = AdamParams(
            learning_rate=st.lr(),
            beta1=o.betas[0],
            beta2=o.betas[1],
            eps=o.eps,
            weight_decay=o.weight_decay,
            grad_clip_norm=st.clip,
        )
        metrics = dict(self.backend.optim_step(adapter_name, params).metrics)
        st.pending_grad, st.clip = False, 0.0
        st.opt_steps += 1
        if "grad_norm" in metrics:
            st.train.grad_norms.append(float(metrics["grad_norm"]))
        return metrics

    def zero_grad(self, *, adapter_name: str = DEFAULT_ADAPTER) -> None:
        """Drop the accumulated gradient; a no-op inside an accumulation window (as upstream)."""
        st = self._st(adapter_name)
        if st.micro != 0 or not st.pending_grad:
            return
        self.backend.adapter_grad(adapter_name, "zero")
        st.pending_grad = False

    def lr_step(self, *, adapter_name: str = DEFAULT_ADAPTER) -> None:
        """Advance the LR schedule by one; a no-op inside an accumulation window (as upstream)."""
        st = self._st(adapter_name)
        if st.micro == 0:
            st.sched_t += 1

    def clip_grad_and_step(
        self,
        max_grad_norm: float = 1.0,
        norm_type: float = 2,
        *,
        adapter_name: str = DEFAULT_ADAPTER,
    ) -> float | None:
        """clip_grad_norm + step + zero_grad + lr_step; returns the unclipped grad norm."""
        norm = self.clip_grad_norm(max_grad_norm, norm_type, adapter_name=adapter_name)
        self.step(adapter_name=adapter_name)
        self.zero_grad(adapter_name=adapter_name)
        self.lr_step(adapter_name=adapter_name)
        return norm
