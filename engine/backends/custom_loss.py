"""Server-side custom losses in a training request (``loss_fn="custom"``): the rows of a request,
and their loss inside the training pass.

Owns `validate_custom_request` (the graph compiled by engine/backends/custom_loss_graph.py, each
row's inputs at their declared ranks, each row's shapes checked against the budgets by
engine/backends/custom_loss_run.py before any compute: nothing of the loss is allocated or run
there), `extra_tokens` (what the loss costs beyond the rows' tokens, which the scheduler charges)
and `request_loss` (the loss of some rows, the signature of `losses.request_loss`, which the
backends call for every other loss).

The semantics are the SDK's client-side `run_loss_handle` (tinker/lib/public_interfaces/
custom_loss.py), so both paths give the same loss and gradient: the graph runs once per datum on
(logprobs, *inputs), where logprobs are the learner's log-probs of ``target_tokens`` (float32,
[N] or [N, K]: the rank of target_tokens) and each input is ``loss_fn_inputs[name]`` as sent
(float32 or int64) at its declared rank; a datum's loss must be a scalar; losses add up over
datums (``loss:sum``); metrics are scalars keyed ``custom/<name>:sum`` (summed over datums) or
``:mean`` (averaged). The summed loss backpropagates into the adapter in the same pass: one round
trip instead of the client path's two (forward, then a cross-entropy surrogate with
``weights = -dLoss/dlogprobs``).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from engine.backends.custom_loss_graph import CompiledLoss, compile_loss
from engine.backends.custom_loss_run import CheckBudget, LossLimits, check_datum, run_loss
from engine.backends.losses import LossSpec, MetricSums
from engine.backends.train_rows import Request, datum
from engine.errors import UserInputError
from engine.protocol import CustomLossGraph, ForwardBackwardInput
from engine.rules import CUSTOM_LOSS_FN

if TYPE_CHECKING:
    from engine.backends.vision import Vision

#: the loss's row spec: target_tokens [N] or [N, K]; its inputs are the graph's, checked here
SPEC = LossSpec(CUSTOM_LOSS_FN, top_k=True)
__all__ = ["SPEC", "CompiledLoss", "LossLimits", "request_loss", "validate_custom_request"]

#: graphs compiled lately, by identity: a request's whole-request check and its slices share the
#: graph object, so they share its compiled form and its shape checks
_COMPILED: OrderedDict[int, tuple[CustomLossGraph, CompiledLoss]] = OrderedDict()
_COMPILED_KEPT = 16


def _compiled(graph: CustomLossGraph) -> CompiledLoss:
    hit = _COMPILED.get(id(graph))
    if hit is not None and hit[0] is graph:
        _COMPILED.move_to_end(id(graph))
        return hit[1]
    compiled = compile_loss(graph)
    _COMPILED[id(graph)] = (graph, compiled)
    while len(_COMPILED) > _COMPILED_KEPT:
        _COMPILED.popitem(last=False)
    return compiled


def _input(arr: np.ndarray, rank: int, field: str) -> np.ndarray:
    """A loss_fn_input at its declared rank (a scalar arrives as one value: the protobuf has no
    empty shape)."""
    if rank == 0 and arr.size == 1:
        return arr.reshape(())
    if arr.ndim != rank:
        raise UserInputError(f"{field}: rank {arr.ndim}, but the custom loss declared rank {rank}")
    if arr.dtype.kind not in "fiub":
        raise UserInputError(f"{field}: must be float32 or int64")
    return arr.astype(np.float32 if arr.dtype.kind == "f" else np.int64, copy=False)


def validate_custom_request(
    inp: ForwardBackwardInput,
    vocab: int,
    max_positions: int,
    vision: Vision | None,
    limits: LossLimits,
) -> Request:
    """A ``custom`` request: its graph compiled, each row's inputs at their declared ranks, and
    each row's shapes checked within ``limits`` (a shape error or a budget fails here, naming the
    node, before any compute)."""
    if inp.custom_loss is None:
        raise UserInputError("loss_fn_config.loss_id: no custom loss attached to this request")
    extra = sorted(set(inp.loss_fn_config or {}) - {"loss_id"})
    if extra:
        raise UserInputError(f"loss_fn_config.{extra[0]}: loss_fn 'custom' takes only loss_id")
    compiled = _compiled(inp.custom_loss)
    budget = CheckBudget(limits)
    if not inp.data:
        raise UserInputError("data: must contain at least one datum")
    data, bounds = [], []
    for i, d in enumerate(inp.data):
        f = f"data[{i}]"
        row = datum(d, f, SPEC, vocab, max_positions, vision)
        if (
            row.targets.ndim != 2
            or (row.two_d and compiled.ranks[0] != 2)
            or (not row.two_d and compiled.ranks[0] != 1)
        ):
            raise UserInputError(
                f"{f}.loss_fn_inputs.target_tokens: logprobs have the rank of target_tokens "
                f"({2 if row.two_d else 1}), but the custom loss declared {compiled.ranks[0]}"
            )
        lfi = d.loss_fn_inputs or {}
        for name, rank in zip(compiled.input_names, compiled.ranks[1:], strict=True):
            field = f"{f}.loss_fn_inputs.{name}"
            if lfi.get(name) is None:
                raise UserInputError(f"{field}: required by custom loss {compiled.name!r}")
            row.inputs[name] = _input(np.asarray(lfi[name]), rank, field)
        lp = tuple(row.targets.shape if row.two_d else row.targets.shape[:1])
        shapes = [(lp, torch.float32)] + [
            (row.inputs[n].shape, _DTYPES[row.inputs[n].dtype.kind]) for n in compiled.input_names
        ]
        bounds.append(check_datum(compiled, shapes, f, budget, grad=not inp.forward_only))
        data.append(row)
    req = Request(SPEC, {}, data, bool(inp.forward_only), False, custom=compiled)
    req.custom_bounds, req.custom_limits = bounds, limits
    return req


_DTYPES = {"f": torch.float32, "i": torch.int64}


def extra_tokens(req: Request) -> list[int]:
    """Each datum's loss cost in tokens, beyond its own tokens (0 for a built-in loss)."""
    if req.custom is None or req.custom_limits is None:
        return [0] * len(req.data)
    grad = not req.forward_only
    return [b.extra_tokens(req.custom_limits, grad) for b in req.custom_bounds]


def request_loss(
    req: Request,
    idx: Sequence[int],
    lps: Sequence[torch.Tensor],
    refs: Sequence[torch.Tensor | None],
    outputs: list[dict[str, np.ndarray]],
    metrics: MetricSums,
    device: torch.device,
) -> torch.Tensor:
    """`losses.request_loss` for a ``custom`` request: the sum of the rows' losses, in datum
    order as the SDK adds them; writes each row's ``logprobs`` output and adds the metrics."""
    compiled, limits = req.custom, req.custom_limits
    assert compiled is not None and limits is not None
    total: torch.Tensor | None = None
    for i, lp in zip(idx, lps, strict=True):
        d = req.data[i]
        lp = lp if d.two_d else lp[:, 0]
        inputs = [torch.from_numpy(d.inputs[n]).to(device) for n in compiled.input_names]
        loss, mets = run_loss(compiled, lp, inputs, f"data[{i}]", req.custom_bounds[i], limits)
        outputs[i] = {"logprobs": lp.detach().cpu().numpy().astype(np.float32)}
        for key, value in mets.items():
            metrics.add(key, float(value.detach().reshape(())), 1)
        total = loss if total is None else total + loss
    assert total is not None
    metrics.add("loss:sum", float(total.detach()))
    return total
