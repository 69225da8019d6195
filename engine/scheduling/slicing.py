"""Slicing a forward_backward request into token-bounded parts, and merging their outputs.

Exact because every loss is a sum over datums: the gradient of the whole request is the sum of
the slices' gradients, and `name:sum` metrics add up. `:mean` metrics are weighted by datums per
slice, as the Tinker SDK does across chunks. DPO pairs (chosen, rejected) stay in one slice, and
each slice of a paired request carries the whole request's pair and chosen-token counts
(`pair_totals`), so DPO's mean reduction stays exact.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import numpy as np

from engine.protocol import ForwardBackwardInput, ForwardBackwardOutput
from engine.rules import EMBEDDING_LOSS_FNS

PAIRED_LOSSES = {"dpo"}


def is_paired(inp: ForwardBackwardInput) -> bool:
    """Datums come in (chosen, rejected) pairs: ``dpo``, and upstream's Tinker DPO convention
    (``importance_sampling`` with ``dpo_*`` loss_fn_config keys, which the backend runs as dpo:
    engine/backends/losses.py ``tinker_dpo``)."""
    if inp.loss_fn in PAIRED_LOSSES:
        return True
    keys = inp.loss_fn_config or {}
    return inp.loss_fn == "importance_sampling" and any(str(k).startswith("dpo_") for k in keys)


def datum_tokens(inp: ForwardBackwardInput) -> list[int]:
    return [max(len(d.tokens), 1) for d in inp.data]


def slice_input(
    inp: ForwardBackwardInput, slice_tokens: int, extra: Sequence[int] | None = None
) -> list[tuple[ForwardBackwardInput, int]]:
    """Consecutive parts of at most ``slice_tokens`` tokens (a single longer datum, or pair, is
    its own part). ``extra``: each datum's cost beyond its tokens (a custom loss's work and
    memory, from `TrainingBackend.validate_input`), counted as tokens. Returns (part, token
    cost) pairs; one part means no slicing."""
    sizes = datum_tokens(inp)
    if extra is not None:
        sizes = [n + int(e) for n, e in zip(sizes, extra, strict=True)]
    total = sum(sizes)
    if total <= slice_tokens or len(inp.data) <= 1 or inp.loss_fn in EMBEDDING_LOSS_FNS:
        return [(inp, total)]
    step = 2 if is_paired(inp) else 1
    parts: list[tuple[ForwardBackwardInput, int]] = []
    start, cost = 0, 0
    for i in range(0, len(inp.data), step):
        unit = sum(sizes[i : i + step])
        if cost and cost + unit > slice_tokens:
            parts.append((replace(inp, data=inp.data[start:i]), cost))
            start, cost = i, 0
        cost += unit
    parts.append((replace(inp, data=inp.data[start:]), cost))
    if step == 2:
        totals = pair_totals(inp)
        parts = [
            (replace(p, loss_fn_config={**totals, **(p.loss_fn_config or {})}), c) for p, c in parts
        ]
    return parts


def pair_totals(inp: ForwardBackwardInput) -> dict[str, float]:
    """The whole request's pair count and chosen-datum weight sum, for the slices of a paired
    request: DPO's mean reduction divides by them (engine/backends/losses.py ``dpo``). Empty
    when the weights cannot be read (the backend's validation then refuses the request)."""
    chosen = 0.0
    try:
        for d in inp.data[0::2]:
            w = (d.loss_fn_inputs or {}).get("weights")
            chosen += (
                float(np.asarray(w, dtype=np.float64).sum()) if w is not None else len(d.tokens)
            )
    except (TypeError, ValueError):
        return {}
    return {"num_pairs": float(len(inp.data) // 2), "num_chosen_tokens": chosen}


def merge_outputs(outs: list[ForwardBackwardOutput]) -> ForwardBackwardOutput:
    outputs = [o for out in outs for o in out.outputs]
    counts = [len(out.outputs) for out in outs]
    metrics: dict[str, float] = {}
    for key in outs[0].metrics:
        values = [out.metrics[key] for out in outs if key in out.metrics]
        reduction = key.rsplit(":", 1)[-1] if ":" in key else "sum"
        if reduction == "sum":
            metrics[key] = float(sum(values))
        elif reduction == "mean":
            w = [c for out, c in zip(outs, counts, strict=True) if key in out.metrics]
            metrics[key] = float(
                sum(v * n for v, n in zip(values, w, strict=True)) / max(sum(w), 1)
            )
        elif reduction == "max":
            metrics[key] = float(max(values))
        elif reduction == "min":
            metrics[key] = float(min(values))
        else:
            metrics[key] = float(values[0])
    return ForwardBackwardOutput(outputs=outputs, metrics=metrics)
