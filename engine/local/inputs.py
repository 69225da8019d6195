"""Turns the datum formats `engine.local.model.MultiLoraTransformersModel` accepts into
`DatumInput`.

Three formats, per datum (a list of them, or one dict, is one batch):

* ``DatumInput`` (engine/protocol.py): used as is.
* Tinker style: ``{"model_input": [...], "target_tokens": [...], "weights": [...], ...}``: every key
  but ``model_input`` becomes a ``loss_fn_inputs`` entry (``weights`` may be omitted: all ones); a
  nested ``"loss_fn_inputs": {...}`` dict works too, and so do objects with ``.model_input`` /
  ``.loss_fn_inputs`` (Tinker SDK ``Datum``; values with ``to_numpy()`` / ``to_ints()`` are read).
* HF style: ``{"input_ids": [...], "labels": [...]}`` (labels default to input_ids; -100 = ignored).
  Shifted as HF's causal-LM loss does: ``tokens = input_ids[:-1]``, ``target_tokens = labels[1:]``
  (position i of tokens predicts labels[i + 1]), ``weights = labels[1:] != -100``; an ignored
  target is replaced by the next input id so that every target is a valid token id. With an
  ``attention_mask``, positions where it is 0 (padding) are dropped first. Other per-datum keys
  (``logprobs``, ``advantages``, ``ref_logprobs`` ...) become loss inputs: an array as long as
  ``input_ids`` is shifted like the labels (``[1:]``), anything else is passed through for the
  backend to validate; ``advantages`` (per token, or one scalar per sequence broadcast to every
  position) is zeroed where the label is -100, since the RL losses take no ``weights`` (``dro``'s
  quadratic penalty is not masked: it covers every position).
  A dict whose ``input_ids`` is a list of lists is a batch (one datum per row; padding removed
  through ``attention_mask``, other keys indexed by row).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from engine.errors import UserInputError
from engine.protocol import DatumInput

IGNORE_INDEX = -100
_HF_SKIP = ("input_ids", "labels", "attention_mask", "position_ids", "token_type_ids")


def _array(value: Any, field: str) -> np.ndarray:
    """numpy view of lists, numpy arrays, torch tensors and Tinker TensorData."""
    if hasattr(value, "to_numpy"):
        value = value.to_numpy()
    elif hasattr(value, "to_ints"):
        value = value.to_ints()
    elif hasattr(value, "detach"):  # torch.Tensor, without importing torch
        value = value.detach().cpu().numpy()
    try:
        return np.asarray(value)
    except (TypeError, ValueError):
        raise UserInputError(f"{field}: must be an array of numbers") from None


def _token_list(value: Any, field: str) -> list[int]:
    arr = _array(value, field)
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iuf"):
        raise UserInputError(f"{field}: must be a flat list of token ids")
    return [int(x) for x in arr.tolist()]


def _is_nested(value: Any) -> bool:
    try:
        return _array(value, "input_ids").ndim == 2
    except UserInputError:  # ragged list of lists
        return (
            isinstance(value, (list, tuple)) and bool(value) and isinstance(value[0], (list, tuple))
        )


def hf_to_datum(item: Mapping[str, Any], field: str = "inputs[0]") -> DatumInput:
    """One HF-style dict (see module doc) as a Tinker-style datum."""
    ids = np.asarray(_token_list(item["input_ids"], f"{field}.input_ids"), dtype=np.int64)
    has_labels = item.get("labels") is not None
    labels = (
        np.asarray(_token_list(item["labels"], f"{field}.labels"), dtype=np.int64)
        if has_labels
        else ids.copy()
    )
    if labels.shape != ids.shape:
        raise UserInputError(
            f"{field}.labels: length {labels.shape[0]} must equal len(input_ids) = {ids.shape[0]}"
        )
    keep = np.ones(ids.shape[0], dtype=bool)
    if item.get("attention_mask") is not None:
        mask = _array(item["attention_mask"], f"{field}.attention_mask").reshape(-1)
        if mask.shape != ids.shape:
            raise UserInputError(f"{field}.attention_mask: length must equal len(input_ids)")
        keep = mask.astype(bool)
    ids, labels = ids[keep], labels[keep]
    L = ids.shape[0]
    if L < 2:
        raise UserInputError(
            f"{field}.input_ids: needs at least 2 tokens (token i predicts labels[i + 1])"
        )
    target = labels[1:].copy()
    ignored = target == IGNORE_INDEX
    target[ignored] = ids[1:][ignored]
    weights = (~ignored).astype(np.float32)
    lfi: dict[str, np.ndarray] = {"target_tokens": target, "weights": weights}
    full_len = keep.shape[0]
    for key, value in item.items():
        if key in _HF_SKIP or value is None:
            continue
        arr = _array(value, f"{field}.{key}")
        if arr.ndim >= 1 and arr.shape[0] == full_len:
            arr = arr[keep][1:]
        if key == "advantages" and arr.size == 1:
            arr = np.full(weights.shape, arr.reshape(()), dtype=np.float32)
        if key == "advantages" and arr.shape == weights.shape:
            arr = arr * weights  # -100 labels: no policy-gradient term there either
        lfi[key] = arr
    return DatumInput(tokens=ids[:-1].tolist(), loss_fn_inputs=lfi)


def tinker_to_datum(item: Any, field: str = "inputs[0]") -> DatumInput:
    """A Tinker-style dict or Datum-like object as a DatumInput."""
    if isinstance(item, Mapping):
        model_input = item["model_input"]
        extra = {k: v for k, v in item.items() if k not in ("model_input", "loss_fn_inputs")}
        nested = item.get("loss_fn_inputs") or {}
    else:
        model_input, extra, nested = item.model_input, {}, item.loss_fn_inputs or {}
    tokens = _token_list(model_input, f"{field}.model_input")
    lfi = {k: _array(v, f"{field}.{k}") for k, v in {**dict(nested), **extra}.items()}
    if "target_tokens" in lfi and "weights" not in lfi:
        lfi["weights"] = np.ones(lfi["target_tokens"].shape, dtype=np.float32)
    return DatumInput(tokens=tokens, loss_fn_inputs=lfi)


def _split_hf_batch(item: Mapping[str, Any]) -> list[dict[str, Any]]:
    rows = list(item["input_ids"])
    out = []
    for r in range(len(rows)):
        row: dict[str, Any] = {}
        for k, v in item.items():
            if v is None:
                continue
            try:
                row[k] = v[r]
            except (TypeError, IndexError, KeyError):
                raise UserInputError(
                    f"inputs.{k}: a batched HF dict needs one entry per row of input_ids"
                ) from None
        out.append(row)
    return out


def to_datums(inputs: Any) -> list[DatumInput]:
    """Normalise ``inputs`` (one datum, a batched HF dict, or a list of datums) to DatumInputs."""
    if isinstance(inputs, (DatumInput, Mapping)) or hasattr(inputs, "model_input"):
        if (
            isinstance(inputs, Mapping)
            and "input_ids" in inputs
            and _is_nested(inputs["input_ids"])
        ):
            inputs = _split_hf_batch(inputs)
        else:
            inputs = [inputs]
    if isinstance(inputs, (str, bytes)) or not hasattr(inputs, "__iter__"):
        raise UserInputError("inputs: must be a datum or a list of datums")
    out: list[DatumInput] = []
    for i, item in enumerate(inputs):
        field = f"inputs[{i}]"
        if isinstance(item, DatumInput):
            out.append(item)
        elif isinstance(item, Mapping) and "input_ids" in item:
            out.append(hf_to_datum(item, field))
        elif (isinstance(item, Mapping) and "model_input" in item) or hasattr(item, "model_input"):
            out.append(tinker_to_datum(item, field))
        elif isinstance(item, Mapping) and "messages" in item:
            raise UserInputError(
                f"{field}: un-encoded trajectory (messages); encode it client-side with the "
                "template (set_template only records it) and pass input_ids/labels"
            )
        else:
            raise UserInputError(
                f"{field}: expected a DatumInput, an HF-style dict with input_ids (and labels) "
                "or a Tinker-style dict with model_input/target_tokens"
            )
    if not out:
        raise UserInputError("inputs: must contain at least one datum")
    return out


def weighted_tokens(data: list[DatumInput]) -> float:
    """Sum of the weights (= number of trained target tokens for 0/1 weights)."""
    total = 0.0
    for d in data:
        w = d.loss_fn_inputs.get("weights")
        if w is None:
            t = d.loss_fn_inputs.get("target_tokens")
            total += float(np.asarray(t).size) if t is not None else float(len(d.tokens))
        else:
            total += float(np.asarray(w, dtype=np.float64).sum())
    return total
