"""Turns the datum formats `engine.local.model.MultiLoraTransformersModel` accepts into
`DatumInput`, and merges the per-call RL inputs (advantages, old log-probs, reference outputs).

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
  ``labels``, ``attention_mask`` and the loss inputs ``logprobs``, ``advantages``,
  ``ref_logprobs``. Every other key is ignored: upstream rows carry dataset columns
  (``messages``, ``query``, ``response``, ``tag``, ``user_data``, ``question``, ``answer``,
  ``prompt``, ``length``, ``position_ids``, ``token_type_ids``, ...). A loss-input array as long as
  input_ids is aligned like the targets (``[1:]`` for hf); anything else is passed through for the
  backend to validate. ``advantages`` (per token, or one scalar per sequence broadcast) is zeroed
  where the label is -100, since the RL losses take no ``weights`` (``dro``'s quadratic penalty
  is not masked: it covers every position).
  A dict whose ``input_ids`` is a list of lists is a batch (one datum per row; the keys above
  indexed by row).

Per-call inputs (`apply_call_inputs`), one entry per sample, as upstream's client sends them:
``advantages`` (a float per sample, or a one-element list, broadcast over the trained positions;
or per-token lists as below), ``old_logps`` (→ loss input
``logprobs``) and reference log-probs (→ ``ref_logprobs``). A per-token list is either the trained
positions only (length = number of weights > 0, scattered there, 0 elsewhere) or one value per
input position of the row as sent (length = len(input_ids)). They replace per-row values.

No torch here: the gateway-facing code paths stay torch-free.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
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


@dataclass
class Batch:
    """Converted inputs: the datums, and for each one where its positions come from: datum
    position j is input position ``src[j]`` of a row of ``row_len`` positions as sent."""

    data: list[DatumInput]
    src: list[np.ndarray]
    row_len: list[int]
    #: the pass's task: None (causal LM) or "embedding" (rows with an ``anchor`` marker)
    task: str | None = None


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
    ids = np.asarray(_token_list(item["input_ids"], f"{field}.input_ids"), dtype=np.int64)
    full_len = ids.shape[0]
    labels = None
    if item.get("labels") is not None:
        labels = np.asarray(_token_list(item["labels"], f"{field}.labels"), dtype=np.int64)
        if labels.shape != ids.shape:
            raise UserInputError(
                f"{field}.labels: length {labels.shape[0]} must equal len(input_ids) = {full_len}"
            )
    keep = np.ones(full_len, dtype=bool)
    if item.get("attention_mask") is not None:
        mask = _array(item["attention_mask"], f"{field}.attention_mask").reshape(-1)
        if mask.shape != ids.shape:
            raise UserInputError(f"{field}.attention_mask: length must equal len(input_ids)")
        keep = mask.astype(bool)
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
        tokens, src = ids[:-1], pos[1:]
    else:
        if L < 1:
            raise UserInputError(f"{field}.input_ids: needs at least 1 token")
        if labels is not None:
            target = labels[keep].copy()
        else:
            target = np.append(ids[1:], IGNORE_INDEX).astype(np.int64)
        ignored = target == IGNORE_INDEX
        target[ignored] = 0  # any valid id: weight 0 (upstream masks the same way)
        tokens, src = ids, pos
    weights = (~ignored).astype(np.float32)
    lfi: dict[str, np.ndarray] = {"target_tokens": target, "weights": weights}
    for key in ROW_LOSS_INPUTS:
        value = item.get(key)
        if value is None:
            continue
        arr = _array(value, f"{field}.{key}")
        if arr.ndim >= 1 and arr.shape[0] == full_len:
            arr = arr[src]
        if key == "advantages" and arr.size == 1:
            arr = np.full(weights.shape, arr.reshape(()), dtype=np.float32)
        if key == "advantages" and arr.shape == weights.shape:
            arr = arr * weights  # -100 labels: no policy-gradient term there either
        lfi[key] = arr
    return DatumInput(tokens=tokens.tolist(), loss_fn_inputs=lfi), src, full_len


def hf_to_datum(item: Mapping[str, Any], field: str = "inputs[0]") -> DatumInput:
    """One HF-style row as a Tinker-style datum (`row_to_datum` with label_format 'hf')."""
    return row_to_datum(item, field, "hf")[0]


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


def _split_row_batch(item: Mapping[str, Any]) -> list[dict[str, Any]]:
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
        if (
            isinstance(inputs, Mapping)
            and "input_ids" in inputs
            and _is_nested(inputs["input_ids"])
        ):
            inputs = _split_row_batch(inputs)
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


def _anchor_flag(value: Any, field: str) -> float:
    try:
        arr = np.asarray(_array(value, field), dtype=np.float64).reshape(-1)
    except (TypeError, ValueError):
        arr = np.array([np.nan, np.nan])
    if arr.shape != (1,) or arr[0] not in (0.0, 1.0):
        raise UserInputError(
            f"{field}: task='embedding' takes one group marker per row, [1] for an anchor (it "
            "starts a group) or [0] for its positive or a negative; got "
            f"{np.asarray(value).tolist()!r}"
        )
    return float(arr[0])


def embedding_row(item: Any, field: str) -> DatumInput:
    """One row of ``task='embedding'`` (upstream's embedding cookbook): ``input_ids``,
    ``attention_mask`` (0 = padding, dropped), ``labels`` = [1] (anchor) or [0]; other keys
    (``position_ids``, dataset columns) are ignored. A DatumInput with ``anchor`` passes as is."""
    if isinstance(item, DatumInput):
        if "anchor" not in item.loss_fn_inputs:
            raise UserInputError(f"{field}.loss_fn_inputs.anchor: required by task='embedding'")
        return item
    if not isinstance(item, Mapping) or "input_ids" not in item:
        raise UserInputError(
            f"{field}: task='embedding' takes rows with input_ids, attention_mask and labels "
            "([1] for an anchor, [0] for its positive)"
        )
    ids = np.asarray(_token_list(item["input_ids"], f"{field}.input_ids"), dtype=np.int64)
    if item.get("attention_mask") is not None:
        mask = _array(item["attention_mask"], f"{field}.attention_mask").reshape(-1)
        if mask.shape != ids.shape:
            raise UserInputError(f"{field}.attention_mask: length must equal len(input_ids)")
        ids = ids[mask.astype(bool)]
    if ids.shape[0] < 1:
        raise UserInputError(f"{field}.input_ids: needs at least 1 token")
    if item.get("labels") is None:
        raise UserInputError(
            f"{field}.labels: required by task='embedding' ([1] for an anchor, [0] for its "
            "positive)"
        )
    anchor = _anchor_flag(item["labels"], f"{field}.labels")
    return DatumInput(
        tokens=ids.tolist(), loss_fn_inputs={"anchor": np.array([anchor], np.float32)}
    )


def embedding_batch(inputs: Any) -> Batch:
    """``task='embedding'`` inputs (a row, a batched row dict, or a list of rows) as a Batch of
    datums with an ``anchor`` marker and no targets (see `embedding_row`)."""
    if isinstance(inputs, Batch):
        return inputs
    if isinstance(inputs, (DatumInput, Mapping)):
        if (
            isinstance(inputs, Mapping)
            and "input_ids" in inputs
            and _is_nested(inputs["input_ids"])
        ):
            inputs = _split_row_batch(inputs)
        else:
            inputs = [inputs]
    if isinstance(inputs, (str, bytes)) or not hasattr(inputs, "__iter__"):
        raise UserInputError("inputs: must be a row or a list of rows")
    data = [embedding_row(item, f"inputs[{i}]") for i, item in enumerate(inputs)]
    if not data:
        raise UserInputError("inputs: must contain at least one row")
    src = [np.arange(len(d.tokens)) for d in data]
    return Batch(data, src, [len(d.tokens) for d in data], task="embedding")


def to_datums(inputs: Any, label_format: str = "rolled") -> list[DatumInput]:
    """`convert`'s datums."""
    return convert(inputs, label_format).data


# ----------------------------------------------------------------------------------- per call


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
        data.append(DatumInput(tokens=d.tokens, loss_fn_inputs=lfi))
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
