"""One training row as the backends use it: the checks that turn a client's datum into arrays.

Owns `Datum` (a row's tokens, targets, weights and loss inputs as numpy arrays), `Request` (a
validated forward_backward request) and `datum`, which checks one datum against its loss's
`LossSpec`, the vocabulary and the context length, with errors that name the field and the rule.
Both the built-in losses (engine/backends/train_batching.py) and traced custom losses
(engine/backends/custom_loss.py) build their rows with it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from engine.backends.losses import LossSpec
from engine.backends.vision import PREPROCESSED_KEYS, Vision, VisionInputs
from engine.errors import UserInputError

if TYPE_CHECKING:
    from engine.backends.custom_loss_graph import CompiledLoss
    from engine.backends.custom_loss_run import LossBound, LossLimits


@dataclass
class Datum:
    tokens: np.ndarray  # int64 [N]
    targets: np.ndarray  # int64 [N, K] (K = 1 unless the loss takes top-K targets)
    weights: np.ndarray  # float32 [N, K] (ones when absent)
    inputs: dict[str, np.ndarray]  # the loss's other float32 [N] loss_fn_inputs, by name
    two_d: bool  # target_tokens came as [N, K]: logprobs are returned as [N, K] too
    vision: VisionInputs | None = None  # this row's images (VL models), in token order


@dataclass
class Request:
    """One validated forward_backward request."""

    loss: LossSpec
    config: dict[str, float]
    data: list[Datum]
    forward_only: bool
    disable_lora: bool
    #: the checked graph of a ``custom`` loss (engine/backends/custom_loss_graph.py), else None
    custom: CompiledLoss | None = None
    #: a custom loss's budgets and each datum's checked bound (engine/backends/custom_loss_run.py)
    custom_limits: LossLimits | None = None
    custom_bounds: list[LossBound] = field(default_factory=list)

    @property
    def units(self) -> list[list[int]]:
        """Datum indices that must share a micro-batch: pairs for DPO, the whole request for an
        embedding loss (it couples every row), else single datums."""
        if self.loss.embedding:
            return [list(range(len(self.data)))]
        step = 2 if self.loss.paired else 1
        return [list(range(i, i + step)) for i in range(0, len(self.data), step)]


def _as_int_array(value, field: str) -> np.ndarray:
    try:
        arr = np.asarray(value)
        integral = (
            arr.size == 0
            or arr.dtype.kind in "iu"
            or (arr.dtype.kind == "f" and np.all(np.isfinite(arr)) and np.all(arr == np.round(arr)))
        )
    except (TypeError, ValueError):  # ragged or non-numeric input
        integral = False
    if not integral:
        raise UserInputError(f"{field}: must be an array of integer token ids")
    return arr.astype(np.int64)


def _as_float_array(value, field: str, shape: tuple[int, ...], n: int) -> np.ndarray:
    try:
        arr = np.asarray(value, dtype=np.float64)
    except (TypeError, ValueError):
        raise UserInputError(f"{field}: must be an array of numbers") from None
    if arr.shape != shape:
        want = f"[{', '.join(map(str, shape))}]"
        raise UserInputError(
            f"{field}: shape {list(arr.shape)} must be {want}, one value per input token "
            f"(len(tokens) = {n})"
        )
    if not np.all(np.isfinite(arr)):
        j = int(np.argwhere(~np.isfinite(arr))[0][0])
        raise UserInputError(f"{field}: must be finite (position {j})")
    return arr.astype(np.float32)


def check_range(arr: np.ndarray, vocab: int, field: str) -> None:
    bad = (arr < 0) | (arr >= vocab)
    if bad.any():
        j = tuple(int(x) for x in np.argwhere(bad)[0])
        pos = j[0] if len(j) == 1 else list(j)
        raise UserInputError(
            f"{field}: token id {int(arr[j])} at position {pos} is out of range [0, {vocab}) "
            "(the vocab size)"
        )


def _tokens_and_images(d, f: str, vision: Vision | None) -> tuple[np.ndarray, VisionInputs | None]:
    """The datum's model input with its images expanded (Tinker image chunks), or checked
    (upstream's pre-processed ``pixel_values`` / ``image_grid_thw``); text rows pass through."""
    images = getattr(d, "images", None) or []
    lfi = d.loss_fn_inputs or {}
    pre = [k for k in PREPROCESSED_KEYS if lfi.get(k) is not None]
    if (images or pre) and vision is None:
        what = f"{f}.model_input.chunks: image chunks" if images else f"{f}.loss_fn_inputs.{pre[0]}"
        raise UserInputError(f"{what}: this base model is text-only; images need a VL model")
    if images and pre:
        raise UserInputError(
            f"{f}.loss_fn_inputs.{pre[0]}: send images either as image chunks or as "
            "pre-processed pixel_values / image_grid_thw, not both"
        )
    if images:
        assert vision is not None
        toks, vis = vision.expand(
            _as_int_array(d.tokens, f"{f}.model_input").tolist(), images, f"{f}.model_input"
        )
        return np.asarray(toks, dtype=np.int64), vis
    toks = _as_int_array(d.tokens, f"{f}.model_input")
    if pre:
        assert vision is not None
        if len(pre) != 2:
            missing = next(k for k in PREPROCESSED_KEYS if k not in pre)
            raise UserInputError(f"{f}.loss_fn_inputs.{missing}: required with {pre[0]}")
        vis = vision.preprocessed(
            toks, lfi["pixel_values"], lfi["image_grid_thw"], f"{f}.loss_fn_inputs"
        )
        return toks, vis
    return toks, None


def datum(
    d, f: str, loss: LossSpec, vocab: int, max_positions: int, vision: Vision | None = None
) -> Datum:
    """Datum ``d`` (field prefix ``f``) checked against ``loss``, the vocabulary and the context
    length, with its images expanded or checked (``vision``); UserInputError naming the field."""
    toks, vis = _tokens_and_images(d, f, vision)
    n = toks.shape[0] if toks.ndim == 1 else 0
    if toks.ndim != 1 or n == 0:
        raise UserInputError(f"{f}.model_input: must contain at least one token")
    if n > max_positions:
        raise UserInputError(
            f"{f}.model_input: length {n} exceeds the model's maximum sequence length "
            f"{max_positions}"
        )
    check_range(toks, vocab, f"{f}.model_input")
    lfi = d.loss_fn_inputs or {}
    field = f"{f}.loss_fn_inputs"
    if loss.embedding:
        if vis is not None:
            raise UserInputError(f"{f}.model_input: embedding losses take text rows only")
        return _embedding_datum(toks, lfi, field, loss)
    if "target_tokens" not in lfi:
        raise UserInputError(f"{field}.target_tokens: required by loss_fn {loss.name!r}")
    tgt = _as_int_array(lfi["target_tokens"], f"{field}.target_tokens")
    two_d_ok = tgt.ndim == 2 and tgt.shape[1] > 0 and loss.top_k
    if tgt.shape[:1] != (n,) or not (tgt.ndim == 1 or two_d_ok):
        want = f"[{n}] or [{n}, K]" if loss.top_k else f"[{n}] (loss_fn {loss.name!r})"
        raise UserInputError(
            f"{field}.target_tokens: shape {list(tgt.shape)} must be {want}, one row per input "
            f"token (len(tokens) = {n})"
        )
    check_range(tgt, vocab, f"{field}.target_tokens")
    w = lfi.get("weights")  # absent: every position counts with weight 1
    if w is None or "weights" not in loss.optional:
        wa = np.ones(tgt.shape, np.float32)
    else:
        try:
            wa = _as_float_array(w, f"{field}.weights", tgt.shape, n)
        except UserInputError as e:
            if "shape" not in str(e):
                raise
            raise UserInputError(
                f"{field}.weights: shape {list(np.shape(w))} must equal the shape of "
                f"target_tokens {list(tgt.shape)} (len(tokens) = {n})"
            ) from None
    inputs: dict[str, np.ndarray] = {}
    for name in (*loss.inputs, *(o for o in loss.optional if o != "weights")):
        if name not in lfi or lfi[name] is None:
            if name in loss.inputs:
                raise UserInputError(f"{field}.{name}: required by loss_fn {loss.name!r}")
            continue
        inputs[name] = _as_float_array(lfi[name], f"{field}.{name}", (n,), n)
    if loss.check is not None:
        loss.check(inputs, field)
    return Datum(
        toks, tgt.reshape(n, -1), wa.reshape(n, -1), inputs, two_d=tgt.ndim == 2, vision=vis
    )


def _embedding_datum(toks: np.ndarray, lfi, field: str, loss: LossSpec) -> Datum:
    """A sentence row of an embedding loss: tokens and its ``anchor`` marker (no targets)."""
    if lfi.get("anchor") is None:
        raise UserInputError(
            f"{field}.anchor: required by loss_fn {loss.name!r} (1 for an anchor, which starts a "
            "group, 0 for its positive or a negative)"
        )
    try:
        a = np.asarray(lfi["anchor"], dtype=np.float64).reshape(-1)
    except (TypeError, ValueError):
        a = np.array([np.nan])
    if a.shape != (1,) or a[0] not in (0.0, 1.0):
        raise UserInputError(
            f"{field}.anchor: {np.asarray(lfi['anchor']).tolist()!r} must be one value, 1 (an "
            "anchor, starting a group) or 0 (its positive or a negative)"
        )
    n = toks.shape[0]
    zeros = np.zeros((n, 1), np.float32)
    return Datum(toks, zeros.astype(np.int64), zeros, {"anchor": a.astype(np.float32)}, False)
