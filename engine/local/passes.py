"""One forward / forward_only / forward_backward pass of `MultiLoraTransformersModel` (`run_pass`).

Owns what sits between the method's arguments and the backend call: converting the inputs
(`engine.local.inputs`, with the explicit ``label_format``), merging the per-call RL inputs
(``advantages``, ``old_logps``, ``ref_outputs``), the loss config of this call (set_loss's, plus
the call's overrides; ``reference_free`` becomes zero reference log-probs here), the ``task``
check, add_metric's metrics (checked before, fed after), and the JSON-able result dict.

Result of every pass (lists and floats only, so it crosses HTTP as is)::

    loss              loss_sum / num_tokens for cross_entropy, loss_sum for every other loss
    loss_sum          the backend's summed loss
    num_tokens        sum of the weights (trained positions)
    logprobs          per sample, log p(target) at each datum position (Tinker alignment)
    logps             per sample, the same at input positions (len(input_ids); 0.0 where no target
                      is defined: dropped padding, and position 0 for label_format 'hf') - what
                      ``ref_outputs`` reads back, as upstream's ``logps``
    elementwise_loss  per sample per-token loss (None for dpo)
    metrics           the backend's metrics (``loss:sum``, ``dpo_*:mean`` ...)

With ``task='embedding'`` (InfonceLoss only, and InfonceLoss only with it) the rows are
sentences with a group marker (`engine.local.inputs.embedding_batch`) and the result is, as
upstream's outputs: ``loss`` (InfoNCE, a mean over the groups; ``loss_sum`` the same value),
``num_tokens`` 0, ``embeddings`` (per sample, the pooled L2-normalised embedding) and ``metrics``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from engine.errors import UserInputError
from engine.local.inputs import (
    Batch,
    aligned_logps,
    apply_call_inputs,
    convert,
    embedding_batch,
    ref_logps_of,
    weighted_tokens,
)
from engine.local.training_config import LOCAL_LOSS_KEYS, resolve_loss
from engine.protocol import (
    EMBEDDING_LOSS_FNS,
    DatumInput,
    ForwardBackwardInput,
    ForwardBackwardOutput,
)

if TYPE_CHECKING:
    from engine.backends.base import TrainingBackend
    from engine.local.adapter_state import AdapterState

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
    call's overrides; the model's own keys are applied to the batch and left out."""
    name, loss_fn, config = loss
    if loss_kwargs:
        config = {**config, **resolve_loss(name, loss_kwargs)[2]}
    local = {k: config[k] for k in LOCAL_LOSS_KEYS if k in config}
    config = {k: v for k, v in config.items() if k not in LOCAL_LOSS_KEYS}
    if float(local.get("reference_free", 0.0)):  # DPO against a uniform reference: log p = 0
        data = [
            DatumInput(
                tokens=d.tokens,
                loss_fn_inputs={
                    **d.loss_fn_inputs,
                    "ref_logprobs": np.zeros(len(d.tokens), dtype=np.float32),
                },
            )
            for d in batch.data
        ]
        batch = Batch(data, batch.src, batch.row_len)
    return loss_fn, config, batch


def _floats(value: Any) -> Any:
    return None if value is None else np.asarray(value, dtype=np.float64).tolist()


def pass_result(out: ForwardBackwardOutput, batch: Batch, loss_fn: str) -> dict[str, Any]:
    """The pass's result dict (see the module doc)."""
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
    return {
        "loss": loss_sum / n_tok if loss_fn == "cross_entropy" and n_tok > 0 else loss_sum,
        "loss_sum": loss_sum,
        "num_tokens": n_tok,
        "logprobs": [_floats(lp) for lp in logprobs],
        "logps": aligned_logps(batch, logprobs),
        "elementwise_loss": [_floats(o.get("elementwise_loss")) for o in out.outputs],
        "metrics": {k: float(v) for k, v in out.metrics.items()},
    }


def run_pass(
    backend: TrainingBackend,
    st: AdapterState,
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
        batch = prepare(inputs, **call)
    loss_fn, config, batch = loss_config(st.loss, loss_kwargs, batch)
    metrics = {"train": st.train_metrics, "eval": st.eval_metrics}.get(mode, [])
    for m in metrics:
        m.check(batch.data)  # before any compute
    inp = ForwardBackwardInput(batch.data, loss_fn, config, forward_only=mode != "train")
    res = pass_result(backend.forward_backward(adapter_name, inp), batch, loss_fn)
    st.last, st.cached = res, (batch, loss_kwargs) if mode != "train" else None
    if mode == "train":
        st.pending_grad = True
        st.train.record(res, len(batch.data))
    elif mode == "eval":
        st.eval.record(res, len(batch.data))
    for m in metrics:
        m.record(batch.data, res)
    return res
