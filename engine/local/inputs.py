"""Turns the datum formats `engine.local.model.MultiLoraTransformersModel` accepts into
`DatumInput` (a `Batch` that remembers where each datum position came from).

Three formats, per datum (a list of them, or one dict, is one batch):

* ``DatumInput`` (engine/protocol.py): used as is.
* Tinker style: ``{"model_input": [...], "target_tokens": [...], "weights": [...], ...}``: every key
  but ``model_input`` becomes a ``loss_fn_inputs`` entry (``weights`` may be omitted: all ones); a
  nested ``"loss_fn_inputs": {...}`` dict works too, and so do objects with ``.model_input`` /
  ``.loss_fn_inputs`` (Tinker SDK ``Datum``; values with ``to_numpy()`` / ``to_ints()`` are read).
* Row style: ``{"input_ids": [...], "labels": [...], "attention_mask": [...]}`` (-100 = ignored).
  Positions where ``attention_mask`` is 0 (padding) are dropped first. How labels line up with
  input_ids is said explicitly by ``label_format`` (never guessed from the data):

  - ``"rolled"`` (upstream Twinkle's template, the default): ``labels[i]`` is the target of
    ``input_ids[i]`` (the last one is normally -100). ``tokens = input_ids``, ``target_tokens =
    labels`` with -100 replaced by token id 0 (weight 0), so per-token outputs line up with
    input_ids. Without labels: ``input_ids[1:] + [-100]``.
  - ``"hf"`` (HF's causal-LM loss): ``tokens = input_ids[:-1]``, ``target_tokens = labels[1:]``
    (position i predicts labels[i + 1]); an ignored target is replaced by the next input id.
    Without labels: labels = input_ids.

  ``weights`` = 1 where the target is not -100. Only these row keys are read: ``input_ids``,
  ``labels``, ``attention_mask``, the loss inputs ``logprobs``, ``advantages``,
  ``ref_logprobs``, and a VL model's processed images ``pixel_values`` / ``image_grid_thw``
  (upstream's multi-modal template; passed on whole). Every other key is ignored: upstream rows
  carry dataset columns (``messages``, ``query``, ``response``, ``tag``, ``user_data``,
  ``question``, ``answer``, ``prompt``, ``length``, ``position_ids``, ``token_type_ids``, ...).
  A loss-input array as long as input_ids is aligned like the targets (``[1:]`` for hf); anything
  else is passed through for the backend to validate. ``advantages`` (per token, or one scalar
  per sequence broadcast) is zeroed where the label is -100, since the RL losses take no
  ``weights`` (``dro``'s quadratic penalty is not masked: it covers every position).
  A dict whose ``input_ids`` is a list of lists is a batch (one datum per row; the keys above
  indexed by row).

Per-call RL inputs (advantages, old log-probs, reference outputs) are merged by
`engine.local.call_inputs`; ``task='embedding'`` rows are read by `engine.local.embedding_inputs`.

No torch here: the gateway-facing code paths stay torch-free.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from engine.errors import UserInputError
from engine.protocol import DatumInput

IGNORE_INDEX = -100
LABEL_FORMATS = ("rolled", "hf")
#: the row keys that are read; every other key of a row is ignored (see the module doc)
ROW_KEYS = ("input_ids", "labels", "attention_mask")
ROW_LOSS_INPUTS = ("logprobs", "advantages", "ref_logprobs")
#: a VL model's images in upstream's rows, already processed (input_ids hold their image tokens)
ROW_IMAGE_INPUTS = ("pixel_values", "image_grid_thw")


@dataclass
class Batch:
    """Converted inputs: the datums, and for each one where its positions come from: datum
    position j is input position ``src[j]`` of a row of ``row_len`` positions as sent."""

    data: list[DatumInput]
    src: list[np.ndarray]
    row_len: list[int]
    #: the pass's task: None (causal LM) or "embedding" (rows with an ``anchor`` marker)
    task: str | None = None


def as_array(value: Any, field: str) -> np.ndarray:
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


def token_list(value: Any, field: str) -> list[int]:
    arr = as_array(value, field)
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iuf"):
        raise UserInputError(f"{field}: must be a flat list of token ids")
    return [int(x) for x in arr.tolist()]


def is_nested(value: Any) -> bool:
    try:
        return as_array(value, "input_ids").ndim == 2
    except UserInputError:  # ragged list of lists
        return (
            isinstance(value, (list, tuple)) and bool(value) and isinstance(value[0], (list, tuple))
        )


def check_label_format(label_format: Any) -> str:
    if label_format not in LABEL_FORMATS:
        raise UserInputError(
            f"label_format: {label_format!r} is not one of {', '.join(LABEL_FORMATS)} ('rolled': "
            "labels[i] is the target of input_ids[i], as upstream's template encodes; 'hf': "
            "labels[i + 1] is, as HF's causal-LM loss shifts)"
        )
    return label_format


def row_to_datum(
    item: Mapping[str, Any], field: str = "inputs[0]", label_format: str = "rolled"
) -> tuple[DatumInput, np.ndarray, int]:
    """One row-style dict (see module doc): (datum, src, row length)."""
    ids = np.asarray(token_list(item["input_ids"], f"{field}.input_ids"), dtype=np.int64)
    full_len = ids.shape[0]
    labels = None
    if item.get("labels") is not None:
        labels = np.asarray(token_list(item["labels"], f"{field}.labels"), dtype=np.int64)
        if labels.shape != ids.shape:
            raise UserInputError(
                f"{field}.labels: length {labels.shape[0]} must equal len(input_ids) = {full_len}"
            )
    keep = np.ones(full_len, dtype=bool)
    if item.get("attention_mask") is not None:
        mask = as_array(item["attention_mask"], f"{field}.attention_mask").reshape(-1)
        if mask.shape != ids.shape:
            raise UserInputError(f"{field}.attention_mask: length must equal len(input_ids)")
        keep = mask.astype(bool)
    tokens, target, ignored, src = _targets(ids, labels, keep, label_format, field)
    weights = (~ignored).astype(np.float32)
    lfi: dict[str, np.ndarray] = {"target_tokens": target, "weights": weights}
    lfi.update(_row_loss_inputs(item, field, full_len, src, weights))
    for key in ROW_IMAGE_INPUTS:  # whole-row arrays, checked against the tokens by the backend
        if item.get(key) is not None:
            lfi[key] = as_array(item[key], f"{field}.{key}")
    return DatumInput(tokens=tokens.tolist(), loss_fn_inputs=lfi), src, full_len


def _targets(
    ids: np.ndarray, labels: np.ndarray | None, keep: np.ndarray, label_format: str, field: str
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The row's unmasked tokens as (input tokens, target per token, ignored targets, src: each
    target's position in the row) for ``label_format`` (module doc)."""
    pos = np.nonzero(keep)[0]
    ids = ids[keep]
    L = ids.shape[0]
    if label_format == "hf":
        if L < 2:
            raise UserInputError(
                f"{field}.input_ids: needs at least 2 tokens (label_format 'hf': token i "
                "predicts labels[i + 1])"
            )
        lab = labels[keep] if labels is not None else ids
        target = lab[1:].copy()
        ignored = target == IGNORE_INDEX
        target[ignored] = ids[1:][ignored]
        return ids[:-1], target, ignored, pos[1:]
    if L < 1:
        raise UserInputError(f"{field}.input_ids: needs at least 1 token")
    if labels is not None:
        target = labels[keep].copy()
    else:
        target = np.append(ids[1:], IGNORE_INDEX).astype(np.int64)
    ignored = target == IGNORE_INDEX
    target[ignored] = 0  # any valid id: weight 0 (upstream masks the same way)
    return ids, target, ignored, pos


def _row_loss_inputs(
    item: Mapping[str, Any], field: str, full_len: int, src: np.ndarray, weights: np.ndarray
) -> dict[str, np.ndarray]:
    """The row's per-token loss inputs (advantages, logprobs, ...), at the targets' positions;
    a scalar advantage is the row's on every token, and no advantage counts where the label is
    ignored."""
    out: dict[str, np.ndarray] = {}
    for key in ROW_LOSS_INPUTS:
        value = item.get(key)
        if value is None:
            continue
        arr = as_array(value, f"{field}.{key}")
        if arr.ndim >= 1 and arr.shape[0] == full_len:
            arr = arr[src]
        if key == "advantages" and arr.size == 1:
            arr = np.full(weights.shape, arr.reshape(()), dtype=np.float32)
        if key == "advantages" and arr.shape == weights.shape:
            arr = arr * weights  # -100 labels: no policy-gradient term there either
        out[key] = arr
    return out


def tinker_to_datum(item: Any, field: str = "inputs[0]") -> DatumInput:
    """A Tinker-style dict or Datum-like object as a DatumInput."""
    if isinstance(item, Mapping):
        model_input = item["model_input"]
        extra = {k: v for k, v in item.items() if k not in ("model_input", "loss_fn_inputs")}
        nested = item.get("loss_fn_inputs") or {}
    else:
        model_input, extra, nested = item.model_input, {}, item.loss_fn_inputs or {}
    tokens = token_list(model_input, f"{field}.model_input")
    lfi = {k: as_array(v, f"{field}.{k}") for k, v in {**dict(nested), **extra}.items()}
    if "target_tokens" in lfi and "weights" not in lfi:
        lfi["weights"] = np.ones(lfi["target_tokens"].shape, dtype=np.float32)
    return DatumInput(tokens=tokens, loss_fn_inputs=lfi)


def split_row_batch(item: Mapping[str, Any]) -> list[dict[str, Any]]:
    rows = list(item["input_ids"])
    out = []
    for r in range(len(rows)):
        row: dict[str, Any] = {}
        for k in (*ROW_KEYS, *ROW_LOSS_INPUTS):
            v = item.get(k)
            if v is None:
                continue
            try:
                row[k] = v[r]
            except (TypeError, IndexError, KeyError):
                raise UserInputError(
                    f"inputs.{k}: a batched row dict needs one entry per row of input_ids"
                ) from None
        out.append(row)
    return out


def convert(inputs: Any, label_format: str = "rolled") -> Batch:
    """Normalise ``inputs`` (one datum, a batched row dict, or a list of datums) to a Batch."""
    check_label_format(label_format)
    if isinstance(inputs, Batch):
        return inputs
    if isinstance(inputs, (DatumInput, Mapping)) or hasattr(inputs, "model_input"):
        if isinstance(inputs, Mapping) and "input_ids" in inputs and is_nested(inputs["input_ids"]):
            inputs = split_row_batch(inputs)
        else:
            inputs = [inputs]
    if isinstance(inputs, (str, bytes)) or not hasattr(inputs, "__iter__"):
        raise UserInputError("inputs: must be a datum or a list of datums")
    out = Batch([], [], [])
    for i, item in enumerate(inputs):
        field = f"inputs[{i}]"
        if isinstance(item, Mapping) and "input_ids" in item:
            d, src, n = row_to_datum(item, field, label_format)
        else:
            if isinstance(item, DatumInput):
                d = item
            elif (isinstance(item, Mapping) and "model_input" in item) or hasattr(
                item, "model_input"
            ):
                d = tinker_to_datum(item, field)
            elif isinstance(item, Mapping) and "messages" in item:
                raise UserInputError(
                    f"{field}: un-encoded trajectory (messages); encode it client-side with the "
                    "template (set_template only records it) and pass input_ids/labels"
                )
            else:
                raise UserInputError(
                    f"{field}: expected a DatumInput, a row with input_ids (and labels) "
                    "or a Tinker-style dict with model_input/target_tokens"
                )
            n = len(d.tokens)
            src = np.arange(n)
        out.data.append(d)
        out.src.append(src)
        out.row_len.append(n)
    if not out.data:
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
