"""A custom loss (engine/backends/custom_loss_graph.py) run within budgets: its cost found before
a datum runs, then the interpreter.

Owns `LossLimits` (the budgets; defaults in engine/config ``ModelConfig.custom_loss``),
`check_datum` (every step's exact output on one datum's shapes, walked on meta tensors by
engine/backends/custom_loss_shapes.py before anything is allocated: a step whose output tensor,
the datum's live intermediates or its total work exceeds its budget is refused naming the node
and the rule), `LossBound` (what the check found: the work and memory the scheduler charges the
tenant for, each step's largest output) and `run_loss` (the interpreter: it drops each
intermediate after its last use, stops at the wall-time bound, and checks a value-dependent
step's real size, e.g. after a boolean mask, before calling it).
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from engine.backends.custom_loss_graph import (
    CompiledLoss,
    check_operands,
    check_value,
    fail,
    resolve,
)
from engine.backends.custom_loss_shapes import META, abstract_call, step_work, tensors, to_meta
from engine.errors import UserInputError


@dataclass(frozen=True)
class LossLimits:
    """The budgets of one custom loss (`engine.config.CustomLossLimits` documents each)."""

    max_tensor_elements: int = 1 << 24
    max_live_bytes: int = 1 << 30
    max_work: int = 1 << 30
    max_seconds: float = 10.0
    max_checks: int = 1 << 17
    work_per_token: int = 4096
    bytes_per_token: int = 16384


@dataclass(frozen=True)
class LossBound:
    """One datum's loss, as checked: its cost and each step's largest output."""

    work: int  # element operations
    peak_bytes: int  # intermediates alive at once, each dropped after its last use
    held_bytes: int  # every intermediate: what autograd may keep until backward
    numel: tuple[int, ...]  # per step, the elements of the tensors it returns
    dependent: frozenset[int]  # steps whose inputs' sizes depend on values: re-checked at run

    def extra_tokens(self, limits: LossLimits, grad: bool) -> int:
        """The loss's cost in tokens, charged on top of the datum's own tokens."""
        mem = self.held_bytes if grad else self.peak_bytes
        return math.ceil(max(self.work / limits.work_per_token, mem / limits.bytes_per_token))


class CheckBudget:
    """The shape checks one request may make: at most ``max_checks`` steps checked and
    ``max_seconds`` spent (a graph of 2,048 nodes on thousands of distinct datum shapes)."""

    def __init__(self, limits: LossLimits) -> None:
        self.limits = limits
        self.left = limits.max_checks
        self.deadline = time.monotonic() + limits.max_seconds


class _Live:
    """Bytes held by live intermediates, per storage (a view keeps its base alive)."""

    def __init__(self, inputs: Sequence[torch.Tensor]) -> None:
        self.count: dict[int, int] = {}
        self.size: dict[int, int] = {}
        for t in inputs:  # the datum's own tensors are not the loss's to count
            self.count[_key(t)], self.size[_key(t)] = 1 << 60, 0
        self.bytes = self.held = 0

    def add(self, v: Any) -> bool:
        """Count ``v``'s tensors; whether it made a new storage (not only views)."""
        fresh = False
        for key, t in {_key(t): t for t in tensors(v)}.items():
            if key in self.count:
                self.count[key] += 1
                continue
            fresh = True
            self.count[key], self.size[key] = 1, t.untyped_storage().nbytes()
            self.bytes += self.size[key]
            self.held += self.size[key]
        return fresh

    def drop(self, v: Any) -> None:
        for key in {_key(t) for t in tensors(v)}:
            self.count[key] -= 1
            if not self.count[key]:
                self.bytes -= self.size.pop(key)
                del self.count[key]


def _key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def check_datum(
    loss: CompiledLoss,
    shapes: Sequence[tuple[tuple[int, ...], torch.dtype]],
    where: str,
    budget: CheckBudget,
    *,
    grad: bool,
) -> LossBound:
    """The bound of one datum whose (logprobs, *inputs) have ``shapes``; a UserInputError naming
    ``where``, the node and the rule when a step fails or a budget is exceeded."""
    key = tuple(shapes)
    if key not in loss.checked:
        if budget.left < len(loss.steps):
            raise UserInputError(
                f"custom loss {loss.name!r}: {where}: checking this request's datums takes "
                f"more than {budget.limits.max_checks} node checks ({len(loss.steps)} nodes per "
                "distinct datum shape); send fewer distinct shapes per request"
            )
        budget.left -= len(loss.steps)
        loss.checked[key] = _walk(loss, shapes, budget, where)
    result = loss.checked[key]
    if isinstance(result, tuple):  # (node, rule): the same error on every datum of this shape
        raise fail(loss.name, f"{where}: {result[0]}", result[1])
    limits = budget.limits
    mem = result.held_first if grad else result.peak_first
    if mem is not None and (result.work_first is None or mem[0] <= result.work_first[0]):
        what = "all of which training keeps until backward" if grad else "alive at once"
        raise fail(
            loss.name,
            f"{where}: {mem[1]}",
            f"the loss's intermediates ({what}) reach {_gib(mem[2])}; at most "
            f"{_gib(limits.max_live_bytes)} per datum",
        )
    if result.work_first is not None:
        raise fail(
            loss.name,
            f"{where}: {result.work_first[1]}",
            f"the loss's work reaches {result.work_first[2]} element operations; at most "
            f"{limits.max_work} per datum (a sort costs n log n, a nuclear norm m·n·min(m, n) "
            "per matrix)",
        )
    return result.bound


@dataclass(frozen=True)
class _Walked:
    bound: LossBound
    # (step, node, amount) where a budget was first passed: live bytes (forward only), every
    # intermediate's bytes (training), work (the walk stops there)
    peak_first: tuple[int, str, int] | None
    held_first: tuple[int, str, int] | None
    work_first: tuple[int, str, int] | None


def _walk(loss: CompiledLoss, shapes: Sequence, budget: CheckBudget, where: str) -> Any:
    """A `_Walked`, or (node, rule) for an error that every datum of these shapes has."""
    limits = budget.limits
    values: list[Any] = [torch.empty(s, dtype=d, device=META) for s, d in shapes]
    dependent = [False] * len(values)
    live = _Live(values)
    work, peak, numel, dep_steps = 0, 0, [], set()
    peak_first = held_first = work_first = None
    for k, step in enumerate(loss.steps):
        node = f"node {step.node!r} ({step.target})"
        if time.monotonic() > budget.deadline:  # not kept: it depends on the load
            raise fail(
                loss.name, f"{where}: {node}", f"the shape check ran past {limits.max_seconds} s"
            )
        args = resolve(step.args, values, META)
        kwargs = resolve(step.kwargs, values, META)
        dep = any(dependent[i] for i in loss.reads[k])
        try:
            check_operands(step, args)
            out, made_dep = abstract_call(step.target, step.fn, args, kwargs)
            check_value(out, limits.max_tensor_elements)
        except Exception as e:  # a shape or type error: the client's graph does not fit its data
            return node, str(e) or type(e).__name__
        values.append(out)
        dependent.append(dep or made_dep)
        if dep:
            dep_steps.add(k)
        numel.append(sum(t.numel() for t in tensors(out)))
        work += step_work(step.target, args, kwargs, out, live.add(out))
        peak = max(peak, live.bytes)
        if peak_first is None and live.bytes > limits.max_live_bytes:
            peak_first = (k, node, live.bytes)
        if held_first is None and live.held > limits.max_live_bytes:
            held_first = (k, node, live.held)
        if work > limits.max_work:
            work_first = (k, node, work)
            break
        for i in loss.frees[k]:
            live.drop(values[i])
            values[i] = None
    bound = LossBound(work, peak, live.held, tuple(numel), frozenset(dep_steps))
    return _Walked(bound, peak_first, held_first, work_first)


def run_loss(
    loss: CompiledLoss,
    logprobs: torch.Tensor,
    inputs: Sequence[torch.Tensor],
    where: str,
    bound: LossBound,
    limits: LossLimits,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One datum's (loss, metrics) within ``bound`` (its `check_datum`); a failing node is a
    UserInputError naming it and ``where``."""
    values: list[Any] = [logprobs, *inputs]
    device = logprobs.device
    deadline = time.monotonic() + limits.max_seconds
    for k, step in enumerate(loss.steps):
        node = f"{where}: node {step.node!r} ({step.target})"
        if time.monotonic() > deadline:
            raise fail(loss.name, node, f"the loss ran past its {limits.max_seconds} s bound")
        args = resolve(step.args, values, device)
        kwargs = resolve(step.kwargs, values, device)
        try:
            check_operands(step, args)
            if k in bound.dependent:  # sizes from values: the real size, before allocating
                out, _ = abstract_call(step.target, step.fn, to_meta(args), to_meta(kwargs))
                n = sum(t.numel() for t in tensors(out))
                if n > bound.numel[k]:
                    raise ValueError(
                        f"on this datum's values its output has {n} elements, more than the "
                        f"{bound.numel[k]} its shape check allowed"
                    )
            out = step.fn(*args, **kwargs)
            check_value(out, limits.max_tensor_elements)
        except Exception as e:  # whatever a client's graph raises is the client's error
            raise fail(loss.name, node, str(e) or type(e).__name__) from None
        values.append(out)
        for i in loss.frees[k]:
            values[i] = None
    out, metrics = values[loss.loss.index], {k: values[r.index] for k, r in loss.metrics.items()}
    if not isinstance(out, torch.Tensor) or out.ndim != 0:
        shape = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise fail(loss.name, where, f"must return a scalar loss, got {shape}")
    for key, value in metrics.items():
        if not isinstance(value, torch.Tensor) or value.numel() != 1:
            raise fail(loss.name, where, f"metric {key!r} must be a one-element tensor")
    return out, metrics
