"""``task='embedding'`` rows (upstream's embedding cookbook) as datums: token ids and an
``anchor`` group marker, no targets. No torch here."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from engine.errors import UserInputError
from engine.local.inputs import Batch, as_array, is_nested, split_row_batch, token_list
from engine.protocol import DatumInput


def _anchor_flag(value: Any, field: str) -> float:
    try:
        arr = np.asarray(as_array(value, field), dtype=np.float64).reshape(-1)
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
    ids = np.asarray(token_list(item["input_ids"], f"{field}.input_ids"), dtype=np.int64)
    if item.get("attention_mask") is not None:
        mask = as_array(item["attention_mask"], f"{field}.attention_mask").reshape(-1)
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
        if isinstance(inputs, Mapping) and "input_ids" in inputs and is_nested(inputs["input_ids"]):
            inputs = split_row_batch(inputs)
        else:
            inputs = [inputs]
    if isinstance(inputs, (str, bytes)) or not hasattr(inputs, "__iter__"):
        raise UserInputError("inputs: must be a row or a list of rows")
    data = [embedding_row(item, f"inputs[{i}]") for i, item in enumerate(inputs)]
    if not data:
        raise UserInputError("inputs: must contain at least one row")
    src = [np.arange(len(d.tokens)) for d in data]
    return Batch(data, src, [len(d.tokens) for d in data], task="embedding")
