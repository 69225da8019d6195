"""In-process training API: `MultiLoraTransformersModel`, upstream Twinkle's local model class.

Owns per-adapter training configuration (loss, Adam(W) hyper-parameters, LR schedule, gradient
accumulation, template/processor) on top of one `TransformersTrainingBackend`, the same engine code
the server runs. Method names and keywords mirror upstream Twinkle, so the remote client can expose
the same surface and a script switches between local and remote by changing an import.

Documented choices (they differ from upstream where the engine follows Tinker):

* Reductions by loss name. The upstream class names follow upstream's reductions, value and
  gradient: ``CrossEntropyLoss`` (``reduction='mean'``, the default) the call's token mean,
  ``GRPOLoss`` the per-sequence token mean then the mean over sequences, ``DPOLoss`` the mean over
  pairs + sft_weight × the chosen token mean (`engine.local.passes.upstream_scaling`, exact
  rescalings of the backend's sums). With ``gradient_accumulation_steps=k`` each of their calls
  counts 1/k, as upstream's clip_grad_norm divides the window's gradient by its number of calls
  (assumed: the usual loop, one forward_backward per `clip_grad_and_step`). The Tinker names
  (cross_entropy, importance_sampling, ppo, cispo, dro, dpo), ``PPOLoss`` and
  ``CrossEntropyLoss(reduction='sum')`` are sums over weighted tokens (Tinker semantics) and
  accumulate as sums: nothing is divided by k, which equals one step on the concatenated batch
  (InfoNCE: see below). Either way the optimizer runs on every
  k-th call of `step`, with the accumulated gradient of the forward_backward calls since the last
  applied step. Inside an accumulation window `zero_grad` and `lr_step` are no-ops (as upstream),
  so the usual loop ``forward_backward(...); clip_grad_and_step()`` works for any k.
* Passes return a JSON-able dict (`engine.local.passes`): ``loss`` (upstream's value for the
  upstream names; ``loss_sum / num_tokens`` for cross_entropy, ``loss_sum`` otherwise),
  ``loss_sum`` (Tinker's sum; for DPOLoss = ``loss``), ``num_tokens``, per-sample ``logprobs``
  (datum positions) and ``logps`` (input positions, upstream's name), ``elementwise_loss``,
  ``metrics``.
* Embedding training (``set_loss('InfonceLoss', temperature, use_batch, hard_negatives=None)``,
  ``forward_backward(inputs, task='embedding')``, ``add_metric('EmbeddingMetric')``): rows carry
  ``labels`` [1] (anchor, starts a group) / [0] (its positive, then optional negatives); each row
  is pooled to the L2-normalised final hidden state (lm_head's input) at its last non-padding
  token, as upstream's TransformersEmbeddingPatch + last-token pooling; the loss is upstream's
  InfoNCE value (mean over groups, engine/backends/losses.py). Differences: with
  gradient_accumulation_steps k > 1 the k per-call gradients are summed (upstream averages
  them); ``hard_negatives`` only None; a request with no anchor, or an anchor without a
  positive, is refused (upstream returns 0 / fails); no cross-device gathering (one device).
* Row labels follow the explicit ``label_format``: "rolled" (default: upstream's template already
  rolled them) or "hf" (shifted here); see `engine.local.inputs`.
* Losses are the backend's (cross_entropy, importance_sampling, ppo, cispo, dro, dpo, and
  infonce for embedding training: ``set_loss('InfonceLoss', ...)`` with
  ``forward_backward(..., task='embedding')``, see `engine.local.passes`); upstream names map
  onto them (`engine.local.training_config.resolve_loss`); metrics are an allow-list
  (`engine.local.metrics`). Adam is AdamW with weight_decay 0 (torch's Adam defaults).
* The backend fuses forward, loss and backward: `forward` runs without gradient and caches its
  inputs, `calculate_loss` returns that forward's loss, `backward` runs forward_backward on the
  cached inputs (a second forward pass).
* `clip_grad_norm` records the clip for the next applied step (the backend clips inside its
  optimizer step, over the whole accumulated gradient) and returns the current, unclipped norm
  of the accumulated gradient (None if the backend gives no access to the gradients).
* Encoding (templates, processors) happens client-side: `set_template` / `set_processor` only
  record what the data toolkit uses; inputs must already be token ids.

Not thread-safe: drive one instance from one thread.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from engine.backends.base import TrainingBackend
from engine.errors import AdapterNotFoundError, ConfigError, UserInputError
from engine.local.adapter_state import TRAIN_CONFIG_FILE, AdapterTraining, MetricAcc
from engine.local.metrics import make_metric
from engine.local.model_checkpoints import DEFAULT_ADAPTER, CheckpointMethods
from engine.local.model_optimizer import OptimizerMethods
from engine.local.passes import run_pass
from engine.local.training_config import (
    UPSTREAM_MEAN,
    make_schedule,
    optimizer_config,
    resolve_loss,
)
from engine.rules import lora_spec_from_config

__all__ = ["DEFAULT_ADAPTER", "TRAIN_CONFIG_FILE", "MultiLoraTransformersModel", "default_data_dir"]


def _call_args(label_format, advantages, old_logps, ref_outputs, task) -> dict[str, Any]:
    return {
        "label_format": label_format,
        "advantages": advantages,
        "old_logps": old_logps,
        "ref_outputs": ref_outputs,
        "task": task,
    }


def default_data_dir() -> Path:
    return Path(os.environ.get("TWINKLE_DATA_DIR") or "./.twinkle").expanduser().absolute()


class MultiLoraTransformersModel(CheckpointMethods, OptimizerMethods):
    """Many LoRA adapters over one frozen HF causal LM, trained in process.

    ``model_id``: a local HF folder, or a known model name ("twinkle/tiny-chat", built under
    ``<data_dir>/models`` on first use). ``backend``: an existing TrainingBackend to drive instead
    of loading one. ``data_dir`` defaults to ``$TWINKLE_DATA_DIR`` or ``./.twinkle``.
    """

    def __init__(
        self,
        model_id: str | os.PathLike,
        *,
        max_lora_rank: int = 64,
        backend: TrainingBackend | None = None,
        data_dir: str | os.PathLike | None = None,
    ):
        self.model_id = str(model_id)
        self.data_dir = Path(data_dir).absolute() if data_dir is not None else default_data_dir()
        if backend is None:
            from engine.backends.train_transformers import TransformersTrainingBackend
            from engine.base_models.registry import resolve_model_dir

            local = Path(self.model_id).expanduser()
            try:
                model_dir = (
                    local if local.is_dir() else resolve_model_dir(self.model_id, self.data_dir)
                )
            except ConfigError as e:
                raise UserInputError(f"model_id: {e}") from None
            backend = TransformersTrainingBackend(
                str(model_dir), max_lora_rank=max_lora_rank, base_model_name=self.model_id
            )
        self.backend = backend
        self._adapters: dict[str, AdapterTraining] = {}

    # ------------------------------------------------------------------------------- adapters

    @property
    def adapter_names(self) -> list[str]:
        return list(self._adapters)

    def _st(self, adapter_name: str) -> AdapterTraining:
        try:
            return self._adapters[adapter_name]
        except KeyError:
            raise AdapterNotFoundError(
                f"adapter {adapter_name!r} is not in this model (add_adapter_to_model first); "
                f"adapters: {sorted(self._adapters) or 'none'}"
            ) from None

    def add_adapter_to_model(
        self, adapter_name: str, config: Any, gradient_accumulation_steps: int = 1
    ) -> None:
        """Add a fresh adapter from a peft ``LoraConfig`` or dict (`lora_spec_from_config`), or
        from a checkpoint directory written by `save` (weights only)."""
        gas = gradient_accumulation_steps
        if isinstance(gas, bool) or not isinstance(gas, int) or gas < 1:
            raise UserInputError(f"gradient_accumulation_steps {gas!r} must be an integer >= 1")
        if adapter_name in self._adapters:
            raise UserInputError(f"adapter_name {adapter_name!r}: this adapter exists already")
        if isinstance(config, (str, os.PathLike)):
            self.load(str(config), adapter_name=adapter_name)
            self._adapters[adapter_name].gas = gas
            return
        spec = lora_spec_from_config(config)
        self.backend.create_adapter(adapter_name, spec)
        self._adapters[adapter_name] = AdapterTraining(spec=spec, gas=gas)

    def remove_adapter(self, adapter_name: str = DEFAULT_ADAPTER) -> None:
        """Drop the adapter, its optimizer state and its configuration (no-op if absent)."""
        self._adapters.pop(adapter_name, None)
        self.backend.delete_adapter(adapter_name)

    def set_template(self, template: Any, *, adapter_name: str = DEFAULT_ADAPTER, **kwargs) -> None:
        """Record the chat template (name or object) the client-side data toolkit encodes with."""
        self._st(adapter_name).template = (template, kwargs) if kwargs else template

    def set_processor(
        self, processor: Any, *, adapter_name: str = DEFAULT_ADAPTER, **kwargs
    ) -> None:
        """Record the input processor (name or object) the client-side data toolkit uses."""
        self._st(adapter_name).processor = (processor, kwargs) if kwargs else processor

    # ------------------------------------------------------------------------------- configuration

    def set_loss(self, loss: Any, *, adapter_name: str = DEFAULT_ADAPTER, **kwargs) -> None:
        """Loss by name, class or instance; kwargs become the loss_fn_config (`resolve_loss`)."""
        st = self._st(adapter_name)
        st.loss = resolve_loss(loss, kwargs)

    def set_optimizer(
        self,
        optimizer: Any = "AdamW",
        *,
        adapter_name: str = DEFAULT_ADAPTER,
        lr: float | None = None,
        betas: tuple[float, float] | None = None,
        eps: float | None = None,
        weight_decay: float | None = None,
        **kwargs,
    ) -> None:
        """AdamW hyper-parameters for later steps (defaults lr 1e-4, betas (0.9, 0.95), eps 1e-12,
        weight_decay 0, decoupled). The optimizer state is kept; only the values change."""
        st = self._st(adapter_name)
        st.optim = optimizer_config(optimizer, lr, betas, eps, weight_decay, kwargs)

    def set_lr_scheduler(
        self, scheduler: Any, *, adapter_name: str = DEFAULT_ADAPTER, **kwargs
    ) -> None:
        """Schedule: "constant" (warmup_steps), "linear" (warmup_steps, total_steps), "cosine"
        (warmup_steps, total_steps, min_lr_ratio or min_lr) or a callable step -> multiplier
        (`LrSchedule`); it restarts at position 0."""
        st = self._st(adapter_name)
        st.schedule, st.sched_t = make_schedule(scheduler, kwargs), 0

    def get_train_configs(self, *, adapter_name: str = DEFAULT_ADAPTER) -> dict[str, Any]:
        """The adapter's LoRA config, gradient accumulation, loss, optimizer, LR schedule (and its
        position / current lr), applied optimizer steps, template and processor."""
        return {"model_id": self.model_id, **self._st(adapter_name).describe(adapter_name)}

    # ------------------------------------------------------------------------------- passes

    def _pass(self, adapter_name: str, inputs: Any, call: dict, loss_kwargs: dict, mode: str):
        st = self._st(adapter_name)
        return run_pass(self.backend, st, adapter_name, inputs, call, loss_kwargs, mode)

    def forward_backward(
        self,
        inputs: Any,
        *,
        adapter_name: str = DEFAULT_ADAPTER,
        label_format: str = "rolled",
        advantages: Any = None,
        old_logps: Any = None,
        ref_outputs: Any = None,
        task: str | None = None,
        **loss_kwargs,
    ) -> dict[str, Any]:
        """Loss and gradient (added to the adapter's accumulated gradient) for one batch.

        ``label_format``: how row labels line up with input_ids ("rolled", upstream's template;
        "hf": shifted by one, see `engine.local.inputs`). Per sample: ``advantages`` (a float, or
        per-token), ``old_logps`` (the sampler's log-probs of the trained positions, or one per
        input position), ``ref_outputs`` (a forward_only result: its ``logps`` are the DPO
        reference). ``task``: None or 'causal_lm', or 'embedding' (exactly with InfonceLoss: rows
        ``{input_ids, attention_mask, labels: [1] anchor / [0] its positive or a negative}``,
        groups anchor, positive, negatives...). ``loss_kwargs`` override the set_loss config for
        this call only. Result: see `engine.local.passes`."""
        call = _call_args(label_format, advantages, old_logps, ref_outputs, task)
        return self._pass(adapter_name, inputs, call, loss_kwargs, "train")

    def forward_only(
        self,
        inputs: Any,
        *,
        adapter_name: str = DEFAULT_ADAPTER,
        label_format: str = "rolled",
        advantages: Any = None,
        old_logps: Any = None,
        ref_outputs: Any = None,
        task: str | None = None,
        disable_lora: bool = False,
        **loss_kwargs,
    ) -> dict[str, Any]:
        """Loss and log-probs without gradient; counted in the evaluation metrics. Arguments as
        forward_backward; ``disable_lora``: the base model's log-probs (DPO reference)."""
        call = _call_args(label_format, advantages, old_logps, ref_outputs, task)
        if disable_lora:
            loss_kwargs = {**loss_kwargs, "disable_lora": True}
        return self._pass(adapter_name, inputs, call, loss_kwargs, "eval")

    def forward(
        self,
        inputs: Any,
        *,
        adapter_name: str = DEFAULT_ADAPTER,
        label_format: str = "rolled",
        advantages: Any = None,
        old_logps: Any = None,
        ref_outputs: Any = None,
        task: str | None = None,
        **loss_kwargs,
    ) -> dict[str, Any]:
        """First half of the two-phase style: a no-gradient pass whose inputs `backward` reuses.
        Not counted in any metrics (the `backward` that follows is). Arguments as
        forward_backward."""
        call = _call_args(label_format, advantages, old_logps, ref_outputs, task)
        return self._pass(adapter_name, inputs, call, loss_kwargs, "forward")

    def calculate_loss(self, *, adapter_name: str = DEFAULT_ADAPTER) -> float:
        """The ``loss`` of the last forward / forward_only / forward_backward (no computation)."""
        st = self._st(adapter_name)
        if st.last is None:
            raise UserInputError("calculate_loss: call forward (or forward_backward) first")
        return float(st.last["loss"])

    def backward(self, *, adapter_name: str = DEFAULT_ADAPTER) -> dict[str, Any]:
        """Gradient of the last `forward`'s batch: runs forward_backward on its cached inputs."""
        st = self._st(adapter_name)
        if st.cached is None:
            raise UserInputError("backward: call forward first (each forward allows one backward)")
        batch, loss_kwargs = st.cached
        return self._pass(adapter_name, batch, {}, loss_kwargs, "train")

    def add_metric(
        self,
        metric_cls: Any,
        *,
        adapter_name: str = DEFAULT_ADAPTER,
        is_training: bool | None = None,
        **kwargs,
    ) -> None:
        """Add a metric (`engine.local.metrics`: DPOMetric(beta), EmbeddingMetric; LossMetric /
        TrainMetric add nothing) to the training passes (``is_training`` True), the evaluation
        passes (False) or both (None); calculate_metric reports it."""
        st = self._st(adapter_name)
        for training in (True, False):
            if is_training is None or bool(is_training) == training:
                metric = make_metric(metric_cls, kwargs)
                if metric is not None:
                    (st.train_metrics if training else st.eval_metrics).append(metric)

    def calculate_metric(
        self, is_training: bool = True, *, adapter_name: str = DEFAULT_ADAPTER
    ) -> dict[str, float | None]:
        """Metrics since the last call for training (forward_backward/backward) or evaluation
        (forward_only) passes, then reset: loss (weighted-token mean for Tinker's cross_entropy,
        mean per batch otherwise), loss_sum, num_tokens, num_sequences, num_batches, grad_norm
        (mean over applied steps, None if none), lr (current), step (applied optimizer steps),
        and the figures of the metrics added with `add_metric`."""
        st = self._st(adapter_name)
        acc = st.train if is_training else st.eval
        # upstream's mean reductions report the mean of the calls' losses, as upstream's LossMetric
        upstream_mean = float(st.loss[2].get(UPSTREAM_MEAN, 0.0)) > 0
        out = {
            **acc.summary(token_mean=st.loss[1] == "cross_entropy" and not upstream_mean),
            "lr": st.lr(),
            "step": st.opt_steps,
        }
        for metric in st.train_metrics if is_training else st.eval_metrics:
            out.update(metric.summary())
        if is_training:
            st.train = MetricAcc()
        else:
            st.eval = MetricAcc()
        return out
