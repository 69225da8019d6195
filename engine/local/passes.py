"""One forward / forward_only / forward_backward pass of `MultiLoraTransformersModel` (`run_pass`).

Owns what sits between the method's arguments and the backend call: converting the inputs
(`engine.local.inputs`, with the explicit ``label_format``), merging the per-call RL inputs
(``advantages``, ``old_logps``, ``ref_outputs``), the loss config of this call (set_loss's, plus
the call's overrides; ``reference_free`` becomes zero reference log-probs here), the ``task``
check, add_metric's metrics (checked before, fed after), and the JSON-able result dict.

Result of every pass (lists and floats only, so it crosses HTTP as is)::

    loss              Tinker names: loss_sum / num_tokens for cross_entropy, loss_sum otherwise.
                      Upstream names (CrossEntropyLoss, GRPOLoss, DPOLoss): upstream's loss value
                      of the call (token mean; per-sequence token mean, batch mean; mean over
                      pairs + sft_weight x chosen token mean), see `upstream_scaling`
    loss_sum          the summed loss, Tinker's (unscaled sum of elementwise_loss) for every
                      name but DPOLoss (there: = loss)
    num_tokens        sum of the weights (trained positions)
    logprobs          per sample, log p(target) at each datum position (Tinker alignment)
    logps             per sample, the same at input positions (len(input_ids); 0.0 where no target
                      is defined: dropped padding, and position 0 for label_format 'hf') - what
                      ``ref_outputs`` reads back, as upstream's ``logps``
    elementwise_loss  per sample per-token loss (None for dpo)
    metrics           the backend's metrics (``loss:sum``, ``dpo_*:mean`` ...); for the
                      upstream names ``loss:sum`` is ``loss`` (the backend's is scaled)

With ``task='embedding'`` (InfonceLoss only, and InfonceLoss only with it) the rows are sentences
with a group marker (`engine.local.embedding_inputs.embedding_batch`) and the result is, as
upstream's outputs: ``loss`` (InfoNCE, a mean over the groups; ``loss_sum`` the same value),
``num_tokens`` 0, ``embeddings`` (per sample, the pooled L2-normalised embedding) and ``metrics``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import numpy as np

from engine.errors import UserInputError
from engine.local.call_inputs import aligned_logps, apply_call_inputs, ref_logps_of
from engine.local.embedding_inputs import embedding_batch
from engine.local.inputs import Batch, convert, weighted_tokens
from engine.local.training_config import LOCAL_LOSS_KEYS, UPSTREAM_MEAN, resolve_loss
from engine.protocol import DatumInput, ForwardBackwardInput, ForwardBackwardOutput
from engine.rules import EMBEDDING_LOSS_FNS

if TYPE_CHECKING:
    from engine.backends.base import TrainingBackend
    from engine.local.adapter_state import AdapterTraining

#: accepted values of ``task``: upstream's default causal-LM training, and embedding training
TASKS = (None, "causal_lm", "embedding")


def check_task(task: Any, loss: tuple[str, str, dict]) -> bool:
    """Whether this pass is an embedding pass; UserInputError unless the task and the loss set
    with set_loss agree (task='embedding' exactly with InfonceLoss)."""
    if task not in TASKS:
        raise UserInputError(
            f"task: {task!r} is not supported; accepted: None, 'causal_lm', 'embedding'"
        )
    embedding = loss[1] in EMBEDDING_LOSS_FNS
    if task == "embedding" and not embedding:
        raise UserInputError(
            f"task: 'embedding' needs an embedding loss; set_loss('InfonceLoss', ...) first "
            f"(the loss is {loss[0]!r})"
        )
    if embedding and task != "embedding":
        raise UserInputError(
            f"task: {loss[0]!r} trains embeddings; pass task='embedding' (got {task!r})"
        )
    return embedding


def with_images(backend: TrainingBackend, inputs: Any) -> Any:
    """Rows carrying ``images`` (the server's template renders ``<image>`` as one image token
    and keeps the image as a data: URL) processed by a VL backend into upstream's
    pre-processed rows (`Vision.expand_row`); anything else unchanged. A text model's backend
    refuses rows with images (as it refuses image chunks)."""
    rows = [inputs] if isinstance(inputs, Mapping) else inputs
    if not isinstance(rows, list) or not any(
        isinstance(r, Mapping) and r.get("images") for r in rows
    ):
        return inputs
    vision = backend.vision
    if vision is None:
        raise UserInputError("inputs: rows with images need a vision-language base model")
    out = [
        vision.expand_row(r, f"inputs[{i}]") if isinstance(r, Mapping) and r.get("images") else r
        for i, r in enumerate(rows)
    ]
    return out[0] if isinstance(inputs, Mapping) else out


def prepare(
    inputs: Any,
    label_format: str = "rolled",
    advantages: Any = None,
    old_logps: Any = None,
    ref_outputs: Any = None,
) -> Batch:
    """The converted batch with the per-call inputs merged in (a cached Batch is used as is)."""
    if isinstance(inputs, Batch):
        return inputs
    batch = convert(inputs, label_format)
    return apply_call_inputs(batch, advantages, old_logps, ref_logps_of(ref_outputs))


def loss_config(
    loss: tuple[str, str, dict], loss_kwargs: dict, batch: Batch
) -> tuple[str, dict, Batch]:
    """(loss_fn, the backend's loss_fn_config, batch) for this call: set_loss's config with the
    call's overrides; the model's own keys are applied to the batch and left out (but
    ``upstream_mean``, which `run_pass` pops)."""
    name, loss_fn, config = loss
    if loss_kwargs:
        config = {**config, **resolve_loss(name, loss_kwargs)[2]}
    local = {k: config[k] for k in LOCAL_LOSS_KEYS if k in config}
    config = {k: v for k, v in config.items() if k not in LOCAL_LOSS_KEYS}
    if float(local.get("reference_free", 0.0)):  # DPO against a uniform reference: log p = 0
        data = [
            replace(
                d,
                loss_fn_inputs={
                    **d.loss_fn_inputs,
                    "ref_logprobs": np.zeros(len(d.tokens), dtype=np.float32),
                },
            )
            for d in batch.data
        ]
        batch = Batch(data, batch.src, batch.row_len)
    return loss_fn, config, batch


def _trained(d: DatumInput) -> float:
    """Trained positions of one datum: its weights > 0 (all positions without weights)."""
    w = d.loss_fn_inputs.get("weights")
    if w is None:
        return float(len(d.tokens))
    return float((np.asarray(w, dtype=np.float64) > 0).sum())


def upstream_scaling(
    loss_fn: str, config: dict, batch: Batch, k: int
) -> tuple[dict, Batch, list[float]]:
    """Upstream Twinkle's mean reductions as our sums (`resolve_loss`'s ``upstream_mean``), for a
    call in a gradient-accumulation window of ``k`` calls (upstream divides the accumulated
    gradient by the number of calls; k = 1 without gradient). Returns (config, batch with the
    scaled inputs, each datum's scale ``c_i``). With B datums and N the call's weights sum:

    * ``cross_entropy`` (CrossEntropyLoss): weights × ``1 / (max(N, 1) k)``, so the sum is the
      token mean ``sum(nll * w) / sum(w)`` over k.
    * ``ppo`` (GRPOLoss): advantages × ``1 / (max(T_i, 1) B k)``, T_i = trained positions of datum
      i: the per-sequence token mean, then the batch mean, over k (the clipped objective
      ``-min(r A, clamp(r) A)`` is positively homogeneous in A, value and gradient alike).
    * ``dpo`` (DPOLoss): the backend's ``mean_reduction`` = 1 / k (mean over pairs + sft_weight ×
      chosen token mean; engine/backends/losses.py).
    """
    data = batch.data
    if loss_fn == "dpo":
        return {**config, "mean_reduction": 1.0 / k}, batch, [1.0] * len(data)
    if loss_fn == "cross_entropy":
        key, scales = "weights", [1.0 / (max(weighted_tokens(data), 1.0) * k)] * len(data)
    elif loss_fn == "ppo":
        key, scales = "advantages", [1.0 / (max(_trained(d), 1.0) * len(data) * k) for d in data]
    else:  # pragma: no cover - resolve_loss sets upstream_mean for these three only
        raise UserInputError(f"no upstream reduction for loss_fn {loss_fn!r}")
    out = []
    for d, c in zip(data, scales, strict=True):
        x = d.loss_fn_inputs
        value = x.get(key)
        if value is None and key == "weights":
            t = x.get("target_tokens")
            value = np.ones(np.shape(t) if t is not None else (len(d.tokens),), np.float32)
        if value is not None:
            x = {**x, key: np.asarray(value, dtype=np.float64) * c}
        out.append(replace(d, loss_fn_inputs=x))  # images and the rest kept
    return config, replace(batch, data=out), scales


def _floats(value: Any) -> Any:
    return None if value is None else np.asarray(value, dtype=np.float64).tolist()


def pass_result(
    out: ForwardBackwardOutput,
    batch: Batch,
    loss_fn: str,
    scales: list[float] | None = None,
    k: int = 1,
) -> dict[str, Any]:
    """The pass's result dict (see the module doc). ``scales`` / ``k``: `upstream_scaling`'s, when
    the inputs were scaled (the backend's ``loss:sum`` is then upstream's loss over k)."""
    loss_sum = float(out.metrics.get("loss:sum", 0.0))
    if batch.task == "embedding":
        return {
            "loss": loss_sum,
            "loss_sum": loss_sum,
            "num_tokens": 0.0,
            "embeddings": [_floats(o.get("embedding")) for o in out.outputs],
            "metrics": {k: float(v) for k, v in out.metrics.items()},
        }
    n_tok = weighted_tokens(batch.data)
    logprobs = [o.get("logprobs") for o in out.outputs]
    elementwise = [o.get("elementwise_loss") for o in out.outputs]
    metrics = {k: float(v) for k, v in out.metrics.items()}
    if scales is None:
        loss = loss_sum / n_tok if loss_fn == "cross_entropy" and n_tok > 0 else loss_sum
    else:  # upstream's value; per-token losses and loss_sum unscaled (Tinker's sums)
        loss = loss_sum * k
        metrics["loss:sum"] = loss
        elementwise = [
            e if e is None or c <= 0 else np.asarray(e, dtype=np.float64) / c
            for e, c in zip(elementwise, scales, strict=True)
        ]
        if loss_fn != "dpo":
            loss_sum = float(sum(np.sum(e) for e in elementwise if e is not None))
        else:
            loss_sum = loss
    return {
        "loss": loss,
        "loss_sum": loss_sum,
        "num_tokens": n_tok,
        "logprobs": [_floats(lp) for lp in logprobs],
        "logps": aligned_logps(batch, logprobs),
        "elementwise_loss": [_floats(e) for e in elementwise],
        "metrics": metrics,
    }


def run_pass(
    backend: TrainingBackend,
    st: AdapterTraining,
    adapter_name: str,
    inputs: Any,
    call: dict,
    loss_kwargs: dict,
    mode: str,
) -> dict[str, Any]:
    """mode: "train" (gradient, training metrics), "eval" (no gradient, evaluation metrics),
    "forward" (no gradient, no metrics, inputs kept for `backward`); ``inputs`` may be the
    Batch `backward` cached; ``call``: label_format, advantages, old_logps, ref_outputs, task."""
    call = dict(call)
    task = call.pop("task", None)
    if isinstance(inputs, Batch):  # `backward` on forward's cached inputs: forward's task
        task = inputs.task
    if check_task(task, st.loss):
        for key in ("advantages", "old_logps", "ref_outputs"):
            if call.get(key) is not None:
                raise UserInputError(f"{key}: not used by task='embedding' (InfonceLoss)")
        batch = embedding_batch(inputs)
    else:
        batch = prepare(with_images(backend, inputs), **call)
    loss_fn, config, batch = loss_config(st.loss, loss_kwargs, batch)
    metrics = {"train": st.train_metrics, "eval": st.eval_metrics}.get(mode, [])
    for m in metrics:
        m.check(batch.data)  # before any compute
    sent, scales, k = batch, None, st.gas if mode == "train" else 1
    if float(config.pop(UPSTREAM_MEAN, 0.0)):
        config, sent, scales = upstream_scaling(loss_fn, config, batch, k)
    inp = ForwardBackwardInput(sent.data, loss_fn, config, forward_only=mode != "train")
    res = pass_result(backend.forward_backward(adapter_name, inp), batch, loss_fn, scales, k)
    st.last, st.cached = res, (batch, loss_kwargs) if mode != "train" else None
    if mode == "train":
        st.pending_grad = True
        st.train.record(res, len(batch.data))
    elif mode == "eval":
        st.eval.record(res, len(batch.data))
    for m in metrics:
        m.record(batch.data, res)
    return res
