"""Per-call RL inputs of a native pass, merged into its datums' loss inputs.

Per-call inputs (`apply_call_inputs`), one entry per sample, as upstream's client sends them:
``advantages`` (a float per sample, or a one-element list, broadcast over the trained positions;
or per-token lists as below), ``old_logps`` (→ loss input
``logprobs``) and reference log-probs (→ ``ref_logprobs``). A per-token list is either the trained
positions only (length = number of weights > 0, scattered there, 0 elsewhere) or one value per
input position of the row as sent (length = len(input_ids)). They replace per-row values.

`aligned_logps` maps the datums' log-probs back to input positions (upstream's ``logps``, what
``ref_outputs`` carries back). No torch here.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

import numpy as np

from engine.errors import UserInputError
from engine.local.inputs import Batch
from engine.protocol import DatumInput


def _trained(d: DatumInput) -> np.ndarray:
    """bool [N]: positions with a weight > 0 (every position when there are no weights)."""
    n = len(d.tokens)
    w = d.loss_fn_inputs.get("weights")
    if w is None:
        return np.ones(n, dtype=bool)
    w = np.asarray(w, dtype=np.float64)
    if not w.size:
        return np.zeros(n, dtype=bool)
    return np.asarray((w.reshape(n, -1) > 0).any(axis=1), dtype=bool)


def _per_sample(value: Any, name: str, n: int) -> list[Any]:
    if isinstance(value, (str, bytes, Mapping)) or not hasattr(value, "__len__"):
        raise UserInputError(f"{name}: must be a list with one entry per sample ({n} samples)")
    if hasattr(value, "tolist"):
        value = value.tolist()
    if len(value) != n:
        raise UserInputError(f"{name}: {len(value)} entries, expected {n} (one per sample)")
    return list(value)


def _scatter(value: Any, field: str, trained: np.ndarray, src: np.ndarray, row_len: int):
    """A per-sample value as a float32 [N] loss input (see the module doc)."""
    try:
        arr = np.asarray(value, dtype=np.float64)
    except (TypeError, ValueError):
        raise UserInputError(f"{field}: must be a number or a list of numbers") from None
    n_trained = int(trained.sum())
    if arr.ndim == 1 and arr.shape[0] == n_trained:
        out = np.zeros(trained.shape, dtype=np.float64)
        out[trained] = arr
    elif arr.ndim == 1 and arr.shape[0] == row_len:
        out = arr[src]
    else:
        got = f"length {arr.shape[0]}" if arr.ndim == 1 else f"shape {list(arr.shape)}"
        raise UserInputError(
            f"{field}: {got}, expected {n_trained} (trained positions) or {row_len} (input_ids)"
        )
    if not np.all(np.isfinite(out)):
        raise UserInputError(f"{field}: must be finite")
    return out.astype(np.float32)


def ref_logps_of(ref_outputs: Any) -> Any:
    """The per-sample ``logps`` of a forward_only result passed as ``ref_outputs``."""
    if ref_outputs is None:
        return None
    if hasattr(ref_outputs, "result") and not isinstance(ref_outputs, Mapping):
        ref_outputs = ref_outputs.result  # upstream's client response object
    if not isinstance(ref_outputs, Mapping) or ref_outputs.get("logps") is None:
        raise UserInputError(
            "ref_outputs: must be the result of forward_only (a dict with per-sample 'logps')"
        )
    return ref_outputs["logps"]


def apply_call_inputs(
    batch: Batch, advantages: Any = None, old_logps: Any = None, ref_logps: Any = None
) -> Batch:
    """Batch with the per-call RL inputs merged into its datums' loss inputs (new datums)."""
    if advantages is None and old_logps is None and ref_logps is None:
        return batch
    n = len(batch.data)
    given = [
        (name, key, _per_sample(v, name, n))
        for name, key, v in (
            ("advantages", "advantages", advantages),
            ("old_logps", "logprobs", old_logps),
            ("ref_outputs.logps", "ref_logprobs", ref_logps),
        )
        if v is not None
    ]
    data = []
    for i, d in enumerate(batch.data):
        trained, src, row_len = _trained(d), batch.src[i], batch.row_len[i]
        lfi = dict(d.loss_fn_inputs)
        for name, key, values in given:
            field = f"{name}[{i}]"
            v = values[i]
            if key == "advantages" and np.size(v) == 1:  # one value per sample: broadcast
                try:
                    a = float(np.asarray(v, dtype=np.float64).reshape(()))
                except (TypeError, ValueError):
                    raise UserInputError(f"{field}: {v!r} must be a number") from None
                if not np.isfinite(a):
                    raise UserInputError(f"{field}: must be finite")
                lfi[key] = np.where(trained, a, 0.0).astype(np.float32)
                continue
            arr = _scatter(v, field, trained, src, row_len)
            lfi[key] = arr * trained if key == "advantages" else arr
        data.append(replace(d, loss_fn_inputs=lfi))  # images and the rest kept
    return Batch(data, batch.src, batch.row_len)


def aligned_logps(batch: Batch, logprobs: Sequence[Any]) -> list[list[float]]:
    """Per-sample log-probs at input positions (``row_len`` long, 0.0 where no datum position
    maps: padding, and position 0 for hf rows), from the datum-aligned ``logprobs``."""
    out = []
    for lp, src, n in zip(logprobs, batch.src, batch.row_len, strict=True):
        row = np.zeros(n, dtype=np.float64)
        if lp is not None:
            a = np.asarray(lp, dtype=np.float64)
            row[src] = a[:, 0] if a.ndim == 2 else a
        out.append(row.tolist())
    return out
