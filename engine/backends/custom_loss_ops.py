"""The allow-list of a server-side custom loss (engine/backends/custom_loss_graph.py): every
operation a traced loss may name, each mapped to a torch (or ``operator`` / ``math``) callable
written out here.

A graph names its calls the way the Tinker SDK encodes torch.fx nodes: a function by its qualified
name (``torch.exp``, ``operator.mul``, ``torch._C._nn.log_sigmoid`` for ``F.logsigmoid``), a tensor
method by its name (``sum``), an attribute read as ``getattr`` with one of `ATTRIBUTES`. A name
missing from these tables is refused; nothing is looked up by a name that came from the client.

Left out on purpose: in-place methods (``add_`` ...) and ``out=``, anything that leaves torch
(``item``, ``tolist``, ``numpy``) or touches autograd (``backward``, ``register_hook``), and every
operation whose output can be much larger than its inputs (``expand``, ``repeat``, ``tile``,
``new_*``, ``torch.zeros(size)``, ``arange``, ``outer``, ``matmul``, ``einsum``, ``one_hot``,
``pad``, ``diag``): with those gone, an output is at most as large as its inputs broadcast
together (or, for ``cat`` / ``stack``, their sum), which the interpreter checks before each call.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

#: operators on tensors and numbers (not on strings or lists: no sequence repetition)
ARITHMETIC = {
    "operator.add": operator.add,
    "operator.sub": operator.sub,
    "operator.mul": operator.mul,
    "operator.truediv": operator.truediv,
    "operator.floordiv": operator.floordiv,
    "operator.mod": operator.mod,
    "operator.pow": operator.pow,
    "operator.neg": operator.neg,
    "operator.pos": operator.pos,
    "operator.abs": operator.abs,
    "operator.eq": operator.eq,
    "operator.ne": operator.ne,
    "operator.lt": operator.lt,
    "operator.le": operator.le,
    "operator.gt": operator.gt,
    "operator.ge": operator.ge,
    "operator.and_": operator.and_,
    "operator.or_": operator.or_,
    "operator.xor": operator.xor,
    "operator.invert": operator.invert,
}

#: named both as ``torch.<name>`` and as a tensor method (the same operation either way)
_SHARED_NAMES = (
    # elementwise
    "exp",
    "exp2",
    "expm1",
    "log",
    "log1p",
    "log2",
    "log10",
    "sqrt",
    "rsqrt",
    "square",
    "abs",
    "neg",
    "sign",
    "sigmoid",
    "tanh",
    "relu",
    "sin",
    "cos",
    "erf",
    "floor",
    "ceil",
    "round",
    "trunc",
    "reciprocal",
    "clamp",
    "clip",
    "clamp_min",
    "clamp_max",
    "minimum",
    "maximum",
    "where",
    "pow",
    "add",
    "sub",
    "mul",
    "div",
    "true_divide",
    "logaddexp",
    "isfinite",
    "isnan",
    "isinf",
    "nan_to_num",
    "lt",
    "le",
    "gt",
    "ge",
    "eq",
    "ne",
    "logical_and",
    "logical_or",
    "logical_not",
    "logical_xor",
    "masked_fill",
    "lerp",
    # reductions and scans
    "sum",
    "mean",
    "nansum",
    "nanmean",
    "prod",
    "logsumexp",
    "amax",
    "amin",
    "max",
    "min",
    "argmax",
    "argmin",
    "std",
    "var",
    "norm",
    "count_nonzero",
    "all",
    "any",
    "cumsum",
    "cumprod",
    "softmax",
    "log_softmax",
    "topk",
    "sort",
    # indexing and shape (never larger than the input)
    "gather",
    "index_select",
    "masked_select",
    "take_along_dim",
    "squeeze",
    "unsqueeze",
    "reshape",
    "flatten",
    "transpose",
    "permute",
    "narrow",
    "select",
    "chunk",
    "split",
    "unbind",
    # detaching, counting
    "detach",
    "numel",
)

#: torch functions only: a tensor the size of a given one, joining tensors, a literal
_TORCH_ONLY = (
    "zeros_like",
    "ones_like",
    "full_like",
    "stack",
    "cat",
    "concat",
    "tensor",
)

_TORCH_NAMES = _SHARED_NAMES + _TORCH_ONLY

_FUNCTIONAL = {
    # what torch.fx records for torch.nn.functional calls (builtins keep their C names)
    "torch._C._nn.log_sigmoid": F.logsigmoid,
    "torch._C._nn.softplus": F.softplus,
    "torch._C._nn.gelu": F.gelu,
    **{
        f"torch.nn.functional.{n}": getattr(F, n)
        for n in (
            "relu",
            "silu",
            "elu",
            "leaky_relu",
            "softmax",
            "log_softmax",
            "normalize",
            "mse_loss",
            "l1_loss",
            "smooth_l1_loss",
            "huber_loss",
            "kl_div",
            "binary_cross_entropy_with_logits",
        )
    },
}

_MATH = {
    f"math.{n}": getattr(math, n)
    for n in (
        "exp",
        "log",
        "log1p",
        "sqrt",
        "fabs",
        "floor",
        "ceil",
    )
}

#: call_function targets by the qualified name the SDK sends
FUNCTIONS: dict[str, Callable[..., Any]] = {
    **ARITHMETIC,
    "operator.getitem": operator.getitem,
    **{f"torch.{n}": getattr(torch, n) for n in _TORCH_NAMES},
    # the SDK names a function where torch defines it: torch.norm is torch.functional.norm
    **{
        f"torch.functional.{n}": getattr(torch, n)
        for n in _TORCH_NAMES
        if getattr(torch.functional, n, None) is getattr(torch, n)
    },
    **_FUNCTIONAL,
    **_MATH,
}

#: tensor methods only: views, casts, copies and size queries
_METHOD_ONLY = (
    "view",
    "view_as",
    "reshape_as",
    "t",
    "float",
    "double",
    "half",
    "bfloat16",
    "long",
    "int",
    "bool",
    "type_as",
    "clone",
    "contiguous",
    "size",
    "dim",
)

_METHOD_NAMES = _SHARED_NAMES + _METHOD_ONLY

#: call_method targets: unbound ``torch.Tensor`` methods, called as ``method(tensor, ...)``
METHODS: dict[str, Callable[..., Any]] = {n: getattr(torch.Tensor, n) for n in _METHOD_NAMES}

#: ``getattr(tensor, name)`` reads a loss may make (torch.fx records ``x.shape`` this way)
ATTRIBUTES: dict[str, Callable[[torch.Tensor], Any]] = {
    "shape": lambda t: t.shape,
    "ndim": lambda t: t.ndim,
    "dtype": lambda t: t.dtype,
    "T": lambda t: t.T,
    "mT": lambda t: t.mT,
}

#: ``{"dtype": name}`` arguments
DTYPES = {
    str(d).removeprefix("torch."): d
    for d in (
        torch.float32,
        torch.float64,
        torch.float16,
        torch.bfloat16,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
        torch.bool,
    )
}
LAYOUTS = {"strided": torch.strided}
MEMORY_FORMATS = {
    "contiguous_format": torch.contiguous_format,
    "preserve_format": torch.preserve_format,
}

#: functions whose tensors come in a list argument and are joined: output = sum of the inputs
JOINS = frozenset({"torch.stack", "torch.cat", "torch.concat"})
#: keyword arguments refused everywhere: ``out=`` writes into an existing tensor (an input)
FORBIDDEN_KWARGS = frozenset({"out"})


def to_dtype(t: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """``Tensor.to`` for dtype conversion only: a ``torch.device`` argument (already mapped to
    where the loss runs) is kept, ``copy`` / ``non_blocking`` are accepted, nothing else."""
    allowed = {"dtype", "device", "copy", "non_blocking"}
    bad = [k for k in kwargs if k not in allowed]
    ok = all(isinstance(a, (torch.dtype, torch.device, bool)) for a in args)
    if bad or not ok:
        raise TypeError("to() takes a dtype (and copy / non_blocking) in a custom loss")
    return t.to(*args, **kwargs)


METHODS["to"] = to_dtype
