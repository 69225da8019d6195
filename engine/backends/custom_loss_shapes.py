"""What one step of a custom loss (engine/backends/custom_loss_graph.py) makes, found without
running it: the exact shape and dtype of every tensor it returns, as ``meta`` tensors (no data,
nothing allocated), and the work it costs.

Owns `abstract_call` (a step's result on meta tensors) and `step_work` (its cost in element
operations). engine/backends/custom_loss_budget.py walks a graph with them before a datum runs.

Elementwise operations, reductions and the built-in losses have shape rules written here (torch's
meta kernels for them go through Python decompositions: 200-1000 us a call, against 5-20 us for a
rule); everything else (indexing, gathers, joins, views, sorts) runs torch's own meta kernel, so
its shape is exactly what the real call would make, advanced indexing included. Operations whose
output size depends on values (a boolean mask, ``masked_select``, one-argument ``where``) get
their largest possible output, and are marked data-dependent: the interpreter checks their real
size again before the call (`custom_loss_budget`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

META = torch.device("meta")

#: a step's name without its namespace: ``torch.exp``, ``exp`` (method) and ``operator.neg``
#: name one operation each
_PREFIXES = (
    "torch.nn.functional.",
    "torch._C._nn.",
    "torch.functional.",
    "torch.",
    "operator.",
)


def op_name(target: str) -> str:
    for p in _PREFIXES:
        if target.startswith(p):
            return target[len(p) :]
    return target


_KEEP = {
    "neg", "pos", "abs", "sign", "relu", "floor", "ceil", "round", "trunc", "square", "clamp",
    "clip", "clamp_min", "clamp_max", "nan_to_num", "detach", "clone", "contiguous",
    "zeros_like", "ones_like", "full_like", "invert", "leaky_relu",
}  # fmt: skip
_FLOAT = {
    "exp", "exp2", "expm1", "log", "log1p", "log2", "log10", "sqrt", "rsqrt", "sigmoid", "tanh",
    "sin", "cos", "erf", "reciprocal", "log_sigmoid", "softplus", "gelu", "silu", "elu",
    "normalize", "truediv", "div", "true_divide", "logaddexp",
}  # fmt: skip
_BOOL = {
    "isfinite", "isnan", "isinf", "logical_not", "eq", "ne", "lt", "le", "gt", "ge",
    "logical_and", "logical_or", "logical_xor",
}  # fmt: skip
_PROMOTE = {
    "add", "sub", "mul", "minimum", "maximum", "pow", "floordiv", "mod", "and_", "or_", "xor",
    "lerp", "masked_fill",
}  # fmt: skip
_ELEMENTWISE = _KEEP | _FLOAT | _BOOL | _PROMOTE
_REDUCE = {"sum", "mean", "nansum", "nanmean", "prod", "logsumexp", "amax", "amin"}
_SCAN = {"cumsum", "cumprod", "softmax", "log_softmax"}
_LOSSES = {
    "mse_loss", "l1_loss", "smooth_l1_loss", "huber_loss", "kl_div",
    "binary_cross_entropy_with_logits",
}  # fmt: skip
#: n log n comparisons
_SORTS = {"sort", "topk", "argsort", "msort"}


def tensors(v: Any) -> list[torch.Tensor]:
    if isinstance(v, torch.Tensor):
        return [v]
    if isinstance(v, (list, tuple)):
        return [t for x in v for t in tensors(x)]
    if isinstance(v, dict):
        return [t for x in v.values() for t in tensors(x)]
    return []


def broadcast(shapes: list[torch.Size]) -> tuple[int, ...]:
    """torch's broadcast of ``shapes`` (a RuntimeError naming them when they do not)."""
    nd = max((len(s) for s in shapes), default=0)
    out = [1] * nd
    for s in shapes:
        for i, n in enumerate(s, nd - len(s)):
            if n != out[i] and n != 1 and out[i] != 1:
                raise RuntimeError(
                    f"shapes {', '.join(str(list(x)) for x in shapes)} do not broadcast together"
                )
            if n != 1:
                out[i] = n
    return tuple(out)


def _float(dt: torch.dtype) -> torch.dtype:
    return dt if dt.is_floating_point else torch.get_default_dtype()


def _promote(args: list[Any]) -> torch.dtype:
    """The result dtype of an elementwise operation on ``args`` (tensors and numbers), by
    torch's promotion (a dimensioned tensor outranks a 0-d one and a number)."""
    acc: torch.Tensor | None = None
    for v in args:
        if not isinstance(v, (torch.Tensor, bool, int, float)):
            continue
        if acc is None:
            acc = v if isinstance(v, torch.Tensor) else torch.tensor(v, device=META)
            continue
        dt = torch.result_type(acc, v)
        dims = acc.ndim > 0 or (isinstance(v, torch.Tensor) and v.ndim > 0)
        if dt != acc.dtype or dims != (acc.ndim > 0):
            acc = torch.empty((1,) if dims else (), dtype=dt, device=META)
    return torch.get_default_dtype() if acc is None else acc.dtype


def _elementwise(name: str, args: tuple, kwargs: dict) -> torch.Tensor:
    ts = tensors((args, kwargs))
    shape = broadcast([t.shape for t in ts])
    first = args[0] if args else None
    if name == "masked_fill" and isinstance(first, torch.Tensor):
        if shape != tuple(first.shape):
            raise RuntimeError(f"the mask does not broadcast to the tensor's shape {list(shape)}")
        dt = first.dtype
    elif name in _BOOL:
        dt = torch.bool
    elif name in _KEEP and isinstance(first, torch.Tensor) and not name.endswith("_like"):
        dt = first.dtype if name not in ("clamp", "clip") else _promote([*args, *kwargs.values()])
    elif name.endswith("_like") and isinstance(first, torch.Tensor):
        dt = kwargs.get("dtype") or first.dtype
    elif name in _FLOAT:
        dt = _float(_promote(list(args)))
    else:
        dt = _promote(list(args) + [v for k, v in kwargs.items() if k != "alpha"])
    return torch.empty(shape, dtype=dt, device=META)


def _dims(dim: Any, ndim: int) -> set[int]:
    if dim is None or dim == () or dim == []:
        return set(range(ndim))
    dims = dim if isinstance(dim, (tuple, list)) else (dim,)
    out = set()
    for d in dims:
        if not isinstance(d, int) or not -max(ndim, 1) <= d < max(ndim, 1):
            raise IndexError(f"dimension {d!r} is out of range for a {ndim}-d tensor")
        out.add(d % max(ndim, 1))
    return out


def _reduce(name: str, args: tuple, kwargs: dict) -> torch.Tensor | None:
    x = args[0]
    if (
        not isinstance(x, torch.Tensor)
        or len(args) > 3
        or set(kwargs) - {"dim", "keepdim", "dtype"}
    ):
        return None  # an unusual signature: torch's meta kernel answers
    dim = args[1] if len(args) > 1 else kwargs.get("dim")
    keep = bool(args[2] if len(args) > 2 else kwargs.get("keepdim", False))
    if name == "logsumexp" and dim is None:
        return None
    dims = _dims(dim, x.ndim)
    shape = (
        [1 if i in dims else n for i, n in enumerate(x.shape)]
        if keep
        else [n for i, n in enumerate(x.shape) if i not in dims]
    )
    dt = kwargs.get("dtype")
    if dt is None:
        integral = not (x.dtype.is_floating_point or x.dtype.is_complex)
        if name in ("sum", "nansum", "prod") and integral:
            dt = torch.int64
        elif name == "logsumexp":
            dt = _float(x.dtype)
        else:
            dt = x.dtype
    return torch.empty(shape, dtype=dt, device=META)


def _scan(name: str, args: tuple, kwargs: dict) -> torch.Tensor | None:
    x = args[0]
    if not isinstance(x, torch.Tensor):
        return None
    dim = args[1] if len(args) > 1 else kwargs.get("dim")
    if dim is None or set(kwargs) - {"dim", "dtype"} or len(args) > 3:
        return None
    _dims(dim, x.ndim)
    dt = kwargs.get("dtype") or (args[2] if len(args) > 2 else None)
    if dt is None:
        integral = not x.dtype.is_floating_point
        dt = torch.int64 if integral and name.startswith("cum") else x.dtype
    return torch.empty(x.shape, dtype=dt, device=META)


def _loss(name: str, args: tuple, kwargs: dict) -> torch.Tensor | None:
    ts = [a for a in args[:2] if isinstance(a, torch.Tensor)]
    if (
        len(ts) != 2
        or len(args) > 2
        or set(kwargs) - {"reduction", "beta", "delta", "log_target", "weight", "pos_weight"}
    ):
        return None
    shape = broadcast([t.shape for t in tensors((args, kwargs))])
    dt = _float(_promote(ts))
    return torch.empty(() if kwargs.get("reduction", "mean") != "none" else shape, dtype=dt,
                       device=META)  # fmt: skip


def _bound_index(idx: Any) -> Any:
    """An index with every boolean mask replaced by its largest nonzero(): ``mask.ndim`` int64
    index tensors of ``mask.numel()`` entries."""
    if isinstance(idx, torch.Tensor) and idx.dtype in (torch.bool, torch.uint8):
        n = idx.numel()
        return tuple(torch.empty(n, dtype=torch.int64, device=META) for _ in range(idx.ndim))
    if isinstance(idx, tuple):
        out: list[Any] = []
        for i in idx:
            b = _bound_index(i)
            out.extend(b if isinstance(i, torch.Tensor) and isinstance(b, tuple) else [b])
        return tuple(out)
    return idx


def _has_mask(v: Any) -> bool:
    if isinstance(v, torch.Tensor):
        return v.dtype in (torch.bool, torch.uint8)
    return isinstance(v, (tuple, list)) and any(_has_mask(x) for x in v)


def _data_dependent(name: str, fn: Callable, args: tuple, kwargs: dict) -> Any:
    """The largest result of a value-dependent-size operation, or NotImplemented."""
    if name == "getitem" and isinstance(args[0], torch.Tensor) and _has_mask(args[1]):
        return fn(args[0], _bound_index(args[1]))
    if name == "masked_select":
        ts = tensors(args)
        n = math.prod(broadcast([t.shape for t in ts]))
        return torch.empty(n, dtype=ts[0].dtype, device=META)
    if name == "where" and len(args) == 1 and not kwargs:
        c = args[0]
        return tuple(torch.empty(c.numel(), dtype=torch.int64, device=META) for _ in range(c.ndim))
    return NotImplemented


def to_meta(v: Any) -> Any:
    """``v`` with every tensor a meta tensor of its shape and dtype (a literal from
    ``torch.tensor`` is made on the CPU; a real datum's tensors, for a re-check)."""
    if isinstance(v, torch.Tensor):
        return v if v.device.type == "meta" else torch.empty(v.shape, dtype=v.dtype, device=META)
    if isinstance(v, tuple) and hasattr(v, "_fields"):  # torch.return_types (values, indices)
        return tuple(to_meta(x) for x in v)
    if isinstance(v, (list, tuple)):
        return type(v)(to_meta(x) for x in v)
    if isinstance(v, dict):
        return {k: to_meta(x) for k, x in v.items()}
    return v


def abstract_call(target: str, fn: Callable, args: tuple, kwargs: dict) -> tuple[Any, bool]:
    """(the result of ``fn(*args, **kwargs)`` with meta tensors, whether its size depends on
    values). Raises what the real call would raise for a shape error."""
    name = op_name(target)
    if not tensors((args, kwargs)):
        return fn(*args, **kwargs), False  # numbers and shapes: exact, and cheap
    out: Any = None
    if name in _ELEMENTWISE:
        out = _elementwise(name, args, kwargs)
    elif name == "where" and len(args) == 3:
        c, x, y = args
        out = _elementwise("where", (x, y, c), {})
        out = torch.empty(out.shape, dtype=_promote([x, y]), device=META)
    elif name in _REDUCE:
        out = _reduce(name, args, kwargs)
    elif name in _SCAN:
        out = _scan(name, args, kwargs)
    elif name in _LOSSES:
        out = _loss(name, args, kwargs)
    if out is not None:
        return out, False
    bound = _data_dependent(name, fn, args, kwargs)
    if bound is not NotImplemented:
        return bound, True
    return to_meta(fn(*args, **kwargs)), False


def _matrix_dims(args: tuple, kwargs: dict) -> tuple[int, int, int] | None:
    """(batch, m, n) of a nuclear norm (its SVD), or None for any other norm."""
    x = args[0] if args else None
    p = args[1] if len(args) > 1 else kwargs.get("p", kwargs.get("ord"))
    if p != "nuc" or not isinstance(x, torch.Tensor):
        return None
    dim = args[2] if len(args) > 2 else kwargs.get("dim")
    dims = sorted(_dims(dim, x.ndim)) if dim is not None else list(range(x.ndim))[-2:]
    if len(dims) != 2:
        return None
    m, n = x.shape[dims[0]], x.shape[dims[1]]
    return max(x.numel() // max(m * n, 1), 1), m, n


def step_work(target: str, args: tuple, kwargs: dict, out: Any, fresh: bool) -> int:
    """A step's cost in element operations: what it reads and writes (a view: 1), times log n
    for a sort, and m·n·min(m, n) per matrix for a nuclear norm (an SVD)."""
    name = op_name(target)
    ins = sum(t.numel() for t in tensors((args, kwargs)))
    work = ins + sum(t.numel() for t in tensors(out)) if fresh else 1
    if name in _SORTS:
        n = max((t.numel() for t in tensors(args)), default=1)
        work += n * max(math.ceil(math.log2(max(n, 2))), 1)
    if name == "norm":
        mat = _matrix_dims(args, kwargs)
        if mat is not None:
            b, m, n = mat
            work += b * m * n * min(m, n)
    return work
