"""The interpreter of a server-side custom loss: the Tinker SDK's traced loss graph
(``create_custom_loss``), checked, then run on one datum's tensors.

Owns `compile_loss` (a wire graph, `engine.protocol.CustomLossGraph`, into a `CompiledLoss`: every
structural check happens here, before any use, with each value's last use, so the interpreter can
free it) and the per-call guards both the shape check and the interpreter apply (`resolve`,
`check_operands`, `check_value`). engine/backends/custom_loss_run.py checks a datum's shapes and
budgets and runs the loss; engine/backends/custom_loss.py runs it inside a training request.

Checks (a UserInputError naming the node and the rule; the gateway answers 400):

* structure: format 1; nodes ``placeholder`` (first, one per declared input, in order),
  ``call_function`` / ``call_method`` (targets from the allow-list in `custom_loss_ops`, names
  never resolved any other way), one ``output`` (last) returning ``(loss, {metric: value})``;
  ``get_attr`` and ``call_module`` are refused (a loss reads only its inputs);
* references: a node may use only nodes defined before it, so a graph has no cycles;
* size: at most `MAX_NODES` nodes, arguments nested at most `MAX_ARG_DEPTH` deep with at most
  `MAX_LITERAL` scalars per node, names and strings at most `MAX_NAME` characters, integers within
  +-2**53; what one datum may allocate and compute is checked per datum before it runs
  (engine/backends/custom_loss_run.py);
* values: numbers, tensors, shapes and dtypes only: Python's operators refuse strings and lists
  (no ``"a" * 10**9``), and a number beyond +-2**53 stops the loss.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

import torch

from engine.backends import custom_loss_ops as ops
from engine.errors import UserInputError
from engine.protocol import CustomLossGraph
from engine.rules import CUSTOM_LOSS_MAX_ARG_DEPTH, CUSTOM_LOSS_MAX_NODES

MAX_NODES = CUSTOM_LOSS_MAX_NODES
MAX_ARG_DEPTH = CUSTOM_LOSS_MAX_ARG_DEPTH
MAX_LITERAL = 4096
MAX_NAME = 128
MAX_INT = 2**53
MAX_INPUTS = 16  # the SDK's limit, logprobs included
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_METRIC = re.compile(r"custom/[a-z0-9_./-]{1,64}:(sum|mean)")  # the SDK's rule


@dataclass(frozen=True)
class _Ref:
    index: int  # into the values of one run: inputs, then the calls' results


@dataclass(frozen=True)
class _Step:
    node: str
    target: str
    fn: Any
    args: tuple
    kwargs: dict[str, Any]
    arithmetic: bool


@dataclass(frozen=True)
class CompiledLoss:
    """A checked graph, ready to run once per datum."""

    name: str
    input_names: tuple[str, ...]  # the loss_fn_inputs it reads, after logprobs
    ranks: tuple[int, ...]  # logprobs first
    steps: tuple[_Step, ...]
    loss: _Ref
    metrics: dict[str, _Ref]
    #: per step, the values (by index) no later step reads: the interpreter drops them there
    frees: tuple[tuple[int, ...], ...] = ()
    #: per step, the values it reads
    reads: tuple[frozenset[int], ...] = ()
    #: shape checks already made, by a datum's input shapes (engine/backends/custom_loss_run.py)
    checked: dict = field(default_factory=dict, compare=False, repr=False)


def _fail(graph: str, where: str, rule: str) -> UserInputError:
    return UserInputError(f"custom loss {graph!r}: {where}: {rule}")


class _Decoder:
    """Turns one node's encoded arguments into values with `_Ref` placeholders."""

    def __init__(self, graph: str, node: str, env: dict[str, int]) -> None:
        self.graph, self.node, self.env, self.scalars = graph, node, env, 0

    def err(self, rule: str) -> UserInputError:
        return _fail(self.graph, f"node {self.node!r}", rule)

    def __call__(self, v: Any, depth: int = 0) -> Any:
        if depth > MAX_ARG_DEPTH:
            raise self.err(f"arguments nested deeper than {MAX_ARG_DEPTH}")
        self.scalars += 1
        if self.scalars > MAX_LITERAL:
            raise self.err(f"more than {MAX_LITERAL} values in its arguments")
        if v is None or isinstance(v, bool):
            return v
        if isinstance(v, int):
            if abs(v) > MAX_INT:
                raise self.err(f"integer {v} is beyond +-2**53")
            return v
        if isinstance(v, float):
            if not math.isfinite(v):
                raise self.err("a non-finite number must be sent as {'float': 'inf'}")
            return v
        if isinstance(v, str):
            if len(v) > MAX_NAME:
                raise self.err(f"a string longer than {MAX_NAME} characters")
            return v
        if isinstance(v, list):
            return [self(x, depth + 1) for x in self._items(v)]
        if isinstance(v, dict) and len(v) == 1:
            return self._tagged(*next(iter(v.items())), depth)
        raise self.err(f"an argument of type {type(v).__name__} is not a value a loss can use")

    def _items(self, v: list) -> list:
        if len(v) > MAX_LITERAL:
            raise self.err(f"a list longer than {MAX_LITERAL}")
        return v

    def _tagged(self, tag: str, v: Any, depth: int) -> Any:
        if tag == "ref":
            if not isinstance(v, str) or v not in self.env:
                raise self.err(
                    f"refers to {v!r}, which is not a node defined before it (nodes come in "
                    "execution order, so a graph cannot have cycles)"
                )
            return _Ref(self.env[v])
        if tag == "tuple" and isinstance(v, list):
            return tuple(self(x, depth + 1) for x in self._items(v))
        if tag == "dict" and isinstance(v, dict):
            if not all(isinstance(k, str) and len(k) <= MAX_NAME for k in v):
                raise self.err("a dict argument needs short string keys")
            return {k: self(x, depth + 1) for k, x in self._items(list(v.items()))}
        if tag == "slice" and isinstance(v, list) and len(v) == 3:
            parts = [self(x, depth + 1) for x in v]
            return slice(*parts)
        if tag == "ellipsis" and v is True:
            return Ellipsis
        if tag == "float" and v in ("inf", "-inf", "nan"):
            return float(v)
        if tag == "device" and isinstance(v, str) and len(v) <= 16:
            return _DEVICE  # the loss runs where the logprobs are; resolved per run
        table = {"dtype": ops.DTYPES, "layout": ops.LAYOUTS, "memory_format": ops.MEMORY_FORMATS}
        if tag in table and isinstance(v, str) and v in table[tag]:
            return table[tag][v]
        if tag in table:
            raise self.err(f"{tag} {v!r} is not allowed; allowed: {', '.join(table[tag])}")
        raise self.err(f"{{{tag!r}: ...}} is not an argument a custom loss can send")


_DEVICE = object()  # placeholder for a torch.device argument


def compile_loss(graph: CustomLossGraph) -> CompiledLoss:
    """Check ``graph`` (module docstring) and build its `CompiledLoss`."""
    name = graph.name
    if not isinstance(name, str) or not 0 < len(name) <= MAX_NAME:
        raise UserInputError(f"name: must be 1 to {MAX_NAME} characters")
    inputs = list(graph.inputs)
    if not 0 < len(inputs) <= MAX_INPUTS:
        raise _fail(name, "inputs", f"must name logprobs and at most {MAX_INPUTS - 1} others")
    for i, (inp, rank) in enumerate(inputs):
        if not (isinstance(inp, str) and _NAME.fullmatch(inp) and len(inp) <= 64):
            raise _fail(name, f"inputs[{i}]", f"{inp!r} is not a lowercase identifier")
        if rank not in ((1, 2) if i == 0 else (0, 1, 2)):
            raise _fail(name, f"inputs[{i}].rank", f"{rank!r} must be 0, 1 or 2 (logprobs 1 or 2)")
    if inputs[0][0] != "logprobs":
        raise _fail(name, "inputs[0]", "must be logprobs")
    if len({n for n, _ in inputs}) != len(inputs):
        raise _fail(name, "inputs", "names must be distinct")
    nodes = list(graph.nodes)
    if len(nodes) > MAX_NODES:
        raise _fail(name, "graph.nodes", f"{len(nodes)} nodes; at most {MAX_NODES}")
    env: dict[str, int] = {}
    steps: list[_Step] = []
    out: tuple[_Ref, dict[str, _Ref]] | None = None
    for k, node in enumerate(nodes):
        op, node_name, target = _node_fields(name, k, node)
        if node_name in env:
            raise _fail(name, f"node {node_name!r}", "the name is used twice")
        if out is not None:
            raise _fail(name, f"node {node_name!r}", "comes after the output node")
        where = f"node {node_name!r} ({op} {target!r})"
        decode = _Decoder(name, node_name, env)
        args, kwargs = decode(node.get("args", [])), decode({"dict": node.get("kwargs", {})})
        if not isinstance(args, list):
            raise _fail(name, where, "args must be a list")
        if op == "placeholder":
            if k >= len(inputs) or target != inputs[k][0] or args or kwargs:
                raise _fail(name, where, "placeholders must be the declared inputs, in order")
            env[node_name] = len(env)
        elif op == "output":
            out = _output(name, where, args)
        elif op in ("call_function", "call_method"):
            if k < len(inputs):
                raise _fail(name, where, f"the first {len(inputs)} nodes must be the inputs")
            steps.append(_step(name, where, node_name, op, target, args, kwargs))
            env[node_name] = len(env)
        else:
            raise _fail(
                name,
                where,
                "op must be placeholder, call_function, call_method or output "
                "(a custom loss reads only logprobs and its inputs: no modules, no captured "
                "tensors)",
            )
    if out is None:
        raise _fail(name, "graph.nodes", "has no output node")
    ranks = tuple(r for _, r in inputs)
    loss, metrics = out
    reads = tuple(frozenset(_refs((s.args, s.kwargs))) for s in steps)
    return CompiledLoss(
        name,
        tuple(n for n, _ in inputs[1:]),
        ranks,
        tuple(steps),
        loss,
        metrics,
        _frees(len(inputs), reads, {loss.index, *(r.index for r in metrics.values())}),
        reads,
    )


def _refs(v: Any) -> list[int]:
    if isinstance(v, _Ref):
        return [v.index]
    if isinstance(v, (list, tuple)):
        return [i for x in v for i in _refs(x)]
    if isinstance(v, dict):
        return [i for x in v.values() for i in _refs(x)]
    if isinstance(v, slice):
        return _refs([v.start, v.stop, v.step])
    return []


def _frees(n_inputs: int, reads: tuple[frozenset[int], ...], kept: set[int]) -> tuple:
    """Per step, the step results whose last reader it is (a result nobody reads goes at once);
    the inputs and the returned values are never dropped."""
    last = {n_inputs + k: k for k in range(len(reads))}
    for k, refs in enumerate(reads):
        for i in refs:
            if i >= n_inputs:
                last[i] = k
    frees: list[list[int]] = [[] for _ in reads]
    for i, k in last.items():
        if i not in kept:
            frees[k].append(i)
    return tuple(tuple(f) for f in frees)


def _node_fields(graph: str, k: int, node: Any) -> tuple[str, str, str]:
    if not isinstance(node, dict):
        raise _fail(graph, f"graph.nodes[{k}]", "must be an object")
    op, name, target = node.get("op"), node.get("name"), node.get("target")
    if not (isinstance(name, str) and _NAME.fullmatch(name) and len(name) <= MAX_NAME):
        raise _fail(graph, f"graph.nodes[{k}].name", f"{name!r} is not an identifier")
    if not (isinstance(op, str) and isinstance(target, str) and len(target) <= MAX_NAME):
        raise _fail(graph, f"node {name!r}", "op and target must be short strings")
    if set(node) - {"op", "name", "target", "args", "kwargs"}:
        raise _fail(graph, f"node {name!r}", f"unknown fields {sorted(set(node) - {'op'})}")
    return op, name, target


def _step(
    graph: str, where: str, node: str, op: str, target: str, args: list, kwargs: dict
) -> _Step:
    # torch.fx records a function's defaults too: torch.norm's ``out=None`` writes nothing
    kwargs = {k: v for k, v in kwargs.items() if not (k in ops.FORBIDDEN_KWARGS and v is None)}
    bad = sorted(set(kwargs) & ops.FORBIDDEN_KWARGS)
    if bad:
        raise _fail(graph, where, f"keyword {bad[0]!r} is not allowed (no writes into tensors)")
    if op == "call_method":
        fn = ops.METHODS.get(target)
        if fn is None:
            raise _fail(
                graph,
                where,
                "tensor method not allowed (allowed: engine/backends/"
                "custom_loss_ops.py METHODS; in-place methods and item/tolist/backward never)",
            )
        if not args:
            raise _fail(graph, where, "a method call needs the tensor as its first argument")
        return _Step(node, target, fn, tuple(args), kwargs, False)
    if target in ("getattr", "builtins.getattr"):
        attr = args[1] if len(args) == 2 and not kwargs else None
        if not isinstance(attr, str) or attr not in ops.ATTRIBUTES:
            raise _fail(
                graph,
                where,
                f"attribute {attr!r} not allowed; allowed: {', '.join(ops.ATTRIBUTES)}",
            )
        return _Step(node, target, ops.ATTRIBUTES[attr], (args[0],), {}, False)
    fn = ops.FUNCTIONS.get(target)
    if fn is None:
        raise _fail(
            graph,
            where,
            "function not allowed (allowed: torch, torch.nn.functional, operator "
            "and math functions listed in engine/backends/custom_loss_ops.py FUNCTIONS)",
        )
    return _Step(node, target, fn, tuple(args), kwargs, target in ops.ARITHMETIC)


def _output(graph: str, where: str, args: list) -> tuple[_Ref, dict[str, _Ref]]:
    value = args[0] if len(args) == 1 else None
    if not (isinstance(value, (tuple, list)) and len(value) == 2):
        raise _fail(graph, where, "the loss must return (loss, metrics)")
    loss, metrics = value
    if not isinstance(loss, _Ref):
        raise _fail(graph, where, "the loss must be a tensor computed by the graph")
    if not isinstance(metrics, dict):
        raise _fail(graph, where, "metrics must be a dict")
    for key, ref in metrics.items():
        if not _METRIC.fullmatch(key):
            raise _fail(graph, where, f"metric {key!r} must be named custom/<name>:sum or :mean")
        if not isinstance(ref, _Ref):
            raise _fail(graph, where, f"metric {key!r} must be a tensor computed by the graph")
    return loss, metrics


# ------------------------------------------------------------------------ per-call guards


def resolve(v: Any, values: list, device: torch.device) -> Any:
    """``v`` with each `_Ref` replaced by its value and the device placeholder by ``device``."""
    if isinstance(v, _Ref):
        return values[v.index]
    if v is _DEVICE:
        return device
    if isinstance(v, list):
        return [resolve(x, values, device) for x in v]
    if isinstance(v, tuple):
        return tuple(resolve(x, values, device) for x in v)
    if isinstance(v, dict):
        return {k: resolve(x, values, device) for k, x in v.items()}
    if isinstance(v, slice):
        return slice(*(resolve(x, values, device) for x in (v.start, v.stop, v.step)))
    return v


def check_value(v: Any, max_elements: int) -> None:
    """A step's result is a value a loss can use, each tensor at most ``max_elements``."""
    if isinstance(v, (torch.Tensor, torch.Size, torch.dtype, bool, float, type(None))):
        if isinstance(v, torch.Tensor) and v.numel() > max_elements:
            shape = list(v.shape)
            raise ValueError(
                f"its output {shape} has {v.numel()} elements; at most {max_elements} per tensor"
            )
        return
    if isinstance(v, int):
        if abs(v) > MAX_INT:
            raise ValueError("the integer result is beyond +-2**53")
        return
    if isinstance(v, (tuple, list)) and len(v) <= MAX_LITERAL:
        for x in v:
            check_value(x, max_elements)
        return
    raise ValueError(f"a result of type {type(v).__name__}, which a loss cannot use")


def check_operands(step: _Step, args: tuple) -> None:
    """Python's operators on numbers and tensors only: no ``"a" * 10**9``, no list repetition,
    no huge Python powers."""
    if not step.arithmetic:
        return
    for a in args:
        if not isinstance(a, (torch.Tensor, int, float, bool)):
            raise TypeError(f"{step.target} takes tensors and numbers, got {type(a).__name__}")
    nums = [a for a in args if not isinstance(a, torch.Tensor)]
    if step.target == "operator.pow" and len(nums) == 2 and abs(nums[1]) > 64:
        raise ValueError("a Python power with an exponent beyond 64")


def fail(graph: str, where: str, rule: str) -> UserInputError:
    """The client's error: the graph, where (datum and node) and the rule, on one short line."""
    return _fail(graph, where, " ".join(rule.split())[:300])
