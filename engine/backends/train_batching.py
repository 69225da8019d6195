"""Input validation, micro-batching and padding for the training backend.

Owns turning a client's `ForwardBackwardInput` into a validated `Request` of `Datum`s (each row
checked by engine/backends/train_rows.py; a ``custom`` loss by engine/backends/custom_loss.py),
the split of rows into micro-batches under a padded
token budget (DPO pairs stay together), and right-padded tensors for one forward pass.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.backends.custom_loss import LossLimits, validate_custom_request
from engine.backends.loss_config import parse_config
from engine.backends.losses import get_loss
from engine.backends.tinker_dpo import tinker_dpo
from engine.backends.train_rows import Datum, Request, datum
from engine.backends.vision import Vision
from engine.errors import UserInputError
from engine.protocol import ForwardBackwardInput
from engine.rules import CUSTOM_LOSS_FN


def _check_groups(data: list[Datum]) -> None:
    """An embedding request: rows in groups (anchor, positive, negatives...), anchor first."""
    anchor = [bool(d.inputs["anchor"][0]) for d in data]
    if not anchor[0]:
        raise UserInputError(
            "data[0].loss_fn_inputs.anchor: the first row must be an anchor (1): rows come in "
            "groups anchor, positive, negatives..."
        )
    for i, a in enumerate(anchor):
        if a and (i + 1 == len(anchor) or anchor[i + 1]):
            raise UserInputError(
                f"data[{i}].loss_fn_inputs.anchor: this anchor has no positive; the row after an "
                "anchor (1) must be its positive (0)"
            )


def validate_request(
    inp: ForwardBackwardInput,
    vocab: int,
    max_positions: int,
    vision: Vision | None = None,
    loss_limits: LossLimits | None = None,
) -> Request:
    """Check the whole request (loss name, config, every datum) before any compute; ``vision``
    (VL models) expands and processes images, a text model refuses them; a custom loss is
    checked within ``loss_limits`` (default: `LossLimits`)."""
    if inp.loss_fn == CUSTOM_LOSS_FN:  # a traced loss: its own checks
        limits = loss_limits or LossLimits()
        return validate_custom_request(inp, vocab, max_positions, vision, limits)
    inp = tinker_dpo(inp)
    loss = get_loss(inp.loss_fn)
    config, disable_lora = parse_config(loss, inp.loss_fn_config, bool(inp.forward_only))
    if not inp.data:
        raise UserInputError("data: must contain at least one datum")
    if loss.paired and len(inp.data) % 2:
        raise UserInputError(
            f"data: loss_fn {loss.name!r} takes (chosen, rejected) pairs in batch order, so an "
            f"even number of datums; got {len(inp.data)}"
        )
    data = [
        datum(d, f"data[{i}]", loss, vocab, max_positions, vision) for i, d in enumerate(inp.data)
    ]
    if loss.embedding:
        _check_groups(data)
    return Request(loss, config, data, bool(inp.forward_only), disable_lora)


def micro_batches(units: Sequence[Sequence[int]], budget: int) -> list[list[int]]:
    """Group consecutive units (each a list of row lengths) so that rows × longest row stays within
    ``budget`` padded tokens (a unit over budget on its own is its own batch). Returns lists of
    unit indices, in order."""
    batches: list[list[int]] = []
    cur: list[int] = []
    rows = longest = 0
    for u, lengths in enumerate(units):
        top = max(lengths)
        if cur and max(longest, top) * (rows + len(lengths)) > budget:
            batches.append(cur)
            cur, rows, longest = [], 0, 0
        cur.append(u)
        rows += len(lengths)
        longest = max(longest, top)
    if cur:
        batches.append(cur)
    return batches


def pad_rows(
    rows: Sequence[Datum], pad_id: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded ``input_ids`` [B, T], ``attention_mask`` [B, T] and targets [B, T, K]."""
    B, T = len(rows), max(d.tokens.shape[0] for d in rows)
    K = max(d.targets.shape[1] for d in rows)
    ids = torch.full((B, T), pad_id, dtype=torch.long)
    mask = torch.zeros((B, T), dtype=torch.long)
    tgt = torch.zeros((B, T, K), dtype=torch.long)
    for r, d in enumerate(rows):
        n, k = d.targets.shape
        ids[r, :n] = torch.from_numpy(d.tokens)
        mask[r, :n] = 1
        tgt[r, :n, :k] = torch.from_numpy(d.targets)
    return ids.to(device), mask.to(device), tgt.to(device)
