"""Multi-adapter LoRA for HF causal LMs (and a VL model's vision tower, opt-in).

Owns `MultiLoraLinear` (a frozen ``nn.Linear`` holding any number of named adapters), the routing
context that says which adapter applies to which rows of the batch (and which image patches, in
a vision tower), adapter creation/removal with PEFT's default init, and saving / loading one
adapter of a model as PEFT files (their format: engine/backends/peft_files.py), so that
``peft.PeftModel.from_pretrained`` loads what we save (and we load what peft saves).

Why not peft at runtime: peft picks one active adapter per model (or per sample only in eval mode);
routing by row segments lets several tenants' adapters share one batch later, with their own ranks.
Adapter parameters are kept outside the module tree (plain dicts), so the base model's
``parameters()`` / ``state_dict()`` never see them and each adapter's optimizer owns only its own
(it also means ``model.to(device)`` does not move them: add adapters after placing the model).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import torch
import torch.nn.functional as F
from torch import nn

from engine.backends.age_seal import Sealer, plain
from engine.backends.peft_files import (
    read_adapter_config,
    read_adapter_tensors,
    write_adapter_files,
)

# The target groups are defined in engine/protocol.py, so the torch-free gateway shares them.
from engine.protocol import LoraSpec
from engine.rules import ATTN_TARGETS, MLP_TARGETS, UNEMBED_TARGETS, VISION_TARGETS

#: PEFT prefixes every key with the PeftModel → LoraModel → base model attribute path.
PEFT_PREFIX = "base_model.model."

#: (adapter_id, row_start, row_end): rows [row_start, row_end) of the batch use that adapter.
Segment = tuple[str, int, int]
T = TypeVar("T")


def row_chunks(
    segments: Sequence[Segment], n: int, lookup: Callable[[str], T | None]
) -> list[tuple[int, T | None]]:
    """The batch's ``n`` rows as consecutive (rows, ``lookup(adapter_id)``) chunks: each segment
    whose adapter ``lookup`` finds, and the rows between (None: base output only); [] when no
    segment's adapter is found. Segments are sorted and disjoint (`lora_routing` checks)."""
    chunks: list[tuple[int, T | None]] = []
    pos = 0
    for adapter_id, start, end in segments:
        if end > n:
            raise ValueError(f"LoRA segment {adapter_id!r} [{start}, {end}) exceeds batch {n}")
        w = lookup(adapter_id)
        if w is None:  # that adapter does not target this layer (base output only)
            continue
        if start > pos:
            chunks.append((start - pos, None))
        chunks.append((end - start, w))
        pos = end
    if chunks and pos < n:
        chunks.append((n - pos, None))
    return chunks


class _Router:
    """Shared by every MultiLoraLinear of one model; holds the current routing segments: over
    batch rows for the language model, over image patches for a VL model's vision tower (its
    blocks see every image's patches concatenated in row order, [patches, dim])."""

    __slots__ = ("segments", "patch_segments")

    def __init__(self) -> None:
        self.segments: tuple[Segment, ...] = ()
        self.patch_segments: tuple[Segment, ...] = ()


@dataclass
class LoraWeights:
    """One adapter inside one layer: delta(x) = (x @ A.T @ B.T) * scaling."""

    A: nn.Parameter  # [r, in_features]
    B: nn.Parameter  # [out_features, r]
    scaling: float


class MultiLoraLinear(nn.Module):
    """A frozen ``nn.Linear`` plus named LoRA adapters, applied per batch-row segment."""

    def __init__(
        self, base: nn.Linear, router: _Router, qualified_name: str, vision: bool = False
    ) -> None:
        super().__init__()
        self.base_layer = base
        self.qualified_name = qualified_name
        self.target_name = qualified_name.rsplit(".", 1)[-1]
        #: in a VL model's vision tower: routed by patch segments, trained with train_vision
        self.vision = vision
        self._router = router
        self.adapters: dict[str, LoraWeights] = {}

    # nn.Linear look-alikes, for code that inspects output embeddings or layer shapes.
    @property
    def weight(self) -> torch.Tensor:
        return self.base_layer.weight

    @property
    def bias(self) -> torch.Tensor | None:
        return self.base_layer.bias

    @property
    def in_features(self) -> int:
        return self.base_layer.in_features

    @property
    def out_features(self) -> int:
        return self.base_layer.out_features

    def peft_key(self, which: str) -> str:
        return f"{PEFT_PREFIX}{self.qualified_name}.lora_{which}.weight"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base_layer(x)
        segments = self._router.patch_segments if self.vision else self._router.segments
        if not segments or not self.adapters:
            return out
        # Each adapted chunk becomes one addmm (base output + delta in the same GEMM); out
        # itself is never written to (autograd may hold it).
        chunks = row_chunks(segments, x.shape[0], self.adapters.get)
        if not chunks:
            return out
        only = chunks[0][1] if len(chunks) == 1 else None
        if only is not None:  # one adapter over the whole batch: no slicing at all
            return _with_delta(out, x, only)
        # split, not x[start:end]: each slice's backward allocates a zeroed full-size gradient
        # and copies into it (with one adapter on the 25 M model, 8x128 rows: 108 such passes a
        # step); split's backward is one cat. 4 tenants fused: 4266 -> 3943 ms a step.
        sizes = [rows for rows, _ in chunks]
        return torch.cat(
            [
                o if w is None else _with_delta(o, xi, w)
                for o, xi, (_, w) in zip(out.split(sizes), x.split(sizes), chunks, strict=True)
            ],
            dim=0,
        )

    def extra_repr(self) -> str:
        ranks = {k: tuple(w.A.shape)[0] for k, w in self.adapters.items()}
        return f"target={self.target_name}, adapters={ranks}"


def _with_delta(out: torch.Tensor, x: torch.Tensor, w: LoraWeights) -> torch.Tensor:
    """``out + (x @ A.T @ B.T) * scaling`` for rows of one adapter, as a new tensor.

    The scaling multiplies the rank-r intermediate, not the [rows, out_features] delta, and the
    add is the GEMM's own (addmm, beta 1): per layer that saves two full-width elementwise passes
    forward and one backward against ``out + B(A(x)) * scaling`` (what peft computes). A 25 M
    Qwen2, 8x128 tokens, rank 8 on every target, 2 CPU threads: forward_backward + optim_step
    880 -> 843 ms, 3.4% under a torch + peft loop's 871 ms (benchmarks/README.md)."""
    h = F.linear(x.reshape(-1, x.shape[-1]).to(w.A.dtype), w.A) * w.scaling  # [rows, r]
    flat = out.reshape(-1, out.shape[-1])
    if flat.dtype == w.B.dtype:
        return torch.addmm(flat, h, w.B.t()).view(out.shape)
    return out + F.linear(h, w.B).to(out.dtype).view(out.shape)


# ----------------------------------------------------------------------------------- model surgery


def _is_vision_target(name: str) -> bool:
    """A projection in a block of a VL model's vision tower (``…visual.blocks.N.attn.qkv``)."""
    parts = name.split(".")
    if "visual" not in parts or "blocks" not in parts:
        return False
    return parts[-1] in VISION_TARGETS or (parts[-1] in MLP_TARGETS and parts[-2] == "mlp")


def _is_target(name: str) -> bool:
    parts = name.split(".")
    last = parts[-1]
    if name == "lm_head":
        return True
    if "layers" not in parts or len(parts) < 2:
        return False
    return (last in ATTN_TARGETS and parts[-2] == "self_attn") or (
        last in MLP_TARGETS and parts[-2] == "mlp"
    )


def inject_multi_lora(model: nn.Module) -> list[str]:
    """Wrap the attention/MLP projections of every decoder layer and ``lm_head`` in place (and
    of every vision-tower block of a VL model: adapters with ``train_vision`` use them).

    Idempotent. Returns the wrapped module names. The base weights are not copied, so a tied
    ``lm_head`` stays tied to the input embedding (and frozen: we never train base weights).
    """
    if getattr(model, "_twinkle_lora_router", None) is not None:
        return [layer.qualified_name for layer in lora_layers(model)]
    router = _Router()
    wrapped: list[str] = []
    for name, module in list(model.named_modules()):
        if not isinstance(module, nn.Linear):
            continue
        vision = _is_vision_target(name)
        if not (vision or _is_target(name)):
            continue
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, MultiLoraLinear(module, router, name, vision))
        wrapped.append(name)
    if not wrapped:
        raise ValueError("inject_multi_lora: no q/k/v/o, gate/up/down or lm_head Linear found")
    # torch types Module.__setattr__'s value as Tensor | Module; plain attributes work at runtime
    model._twinkle_lora_router = router  # pyright: ignore[reportArgumentType]
    return wrapped


def lora_layers(model: nn.Module) -> Iterator[MultiLoraLinear]:
    """The wrapped layers in module order (the order adapters are initialised and saved in)."""
    for module in model.modules():
        if isinstance(module, MultiLoraLinear):
            yield module


def _patch_segments(segments: Sequence[Segment], patches: Sequence[int]) -> tuple[Segment, ...]:
    """Row segments as segments of the vision tower's patch sequence, ``patches[r]`` being row
    r's image patch count (0 without images)."""
    offsets = [0]
    for n in patches:
        offsets.append(offsets[-1] + int(n))
    out = []
    for adapter_id, start, end in segments:
        if end > len(patches):
            raise ValueError(f"lora_routing: segment {(adapter_id, start, end)} beyond patches")
        if offsets[end] > offsets[start]:
            out.append((adapter_id, offsets[start], offsets[end]))
    return tuple(out)


@contextlib.contextmanager
def lora_routing(
    model: nn.Module, segments: Sequence[Segment], patches: Sequence[int] = ()
) -> Iterator[None]:
    """Within the block, rows [start, end) of every batch go through adapter ``adapter_id``.

    Segments must not overlap; rows outside all segments get the base model only. Nesting restores
    the outer routing on exit. ``patches`` (VL models): each batch row's image patch count, for
    the vision tower's layers; without it the tower runs as the base model.
    """
    router: _Router | None = getattr(model, "_twinkle_lora_router", None)
    if router is None:
        raise ValueError("lora_routing: model has no MultiLoraLinear (call inject_multi_lora)")
    ordered = tuple(sorted(((str(a), int(s), int(e)) for a, s, e in segments), key=lambda t: t[1]))
    pos = 0
    for adapter_id, start, end in ordered:
        if start < pos or end <= start:
            raise ValueError(f"lora_routing: bad or overlapping segment {(adapter_id, start, end)}")
        pos = end
    previous = router.segments, router.patch_segments
    router.segments = ordered
    router.patch_segments = _patch_segments(ordered, patches) if patches else ()
    try:
        yield
    finally:
        router.segments, router.patch_segments = previous


# ----------------------------------------------------------------------------------- adapters


def target_module_names(spec: LoraSpec) -> list[str]:
    """Short module names an adapter with ``spec`` trains (Tinker's three switches)."""
    names: list[str] = []
    if spec.train_attn:
        names += ATTN_TARGETS
    if spec.train_mlp:
        names += MLP_TARGETS
    if spec.train_unembed:
        names += UNEMBED_TARGETS
    return names


def add_adapter(model: nn.Module, adapter_id: str, spec: LoraSpec) -> None:
    """Add a fresh adapter with PEFT's default init: A ~ kaiming_uniform_(a=√5), B = 0.

    A is drawn from a generator seeded with ``spec.seed``, in module order, so the init does not
    depend on the global RNG or on other adapters. Parameters are float32 on the base's device.
    """
    targets = set(target_module_names(spec))
    layers = [
        layer
        for layer in lora_layers(model)
        if (spec.train_vision if layer.vision else layer.target_name in targets)
    ]
    if not layers:
        raise ValueError(f"adapter {adapter_id!r}: spec selects no module of this model")
    if any(adapter_id in layer.adapters for layer in lora_layers(model)):
        raise ValueError(f"adapter {adapter_id!r} already exists")
    gen = torch.Generator(device="cpu").manual_seed(int(spec.seed))
    scaling = float(spec.alpha) / int(spec.rank)
    for layer in layers:
        a = torch.empty(spec.rank, layer.in_features, dtype=torch.float32)
        nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=gen)
        b = torch.zeros(layer.out_features, spec.rank, dtype=torch.float32)
        device = layer.base_layer.weight.device
        layer.adapters[adapter_id] = LoraWeights(
            A=nn.Parameter(a.to(device)), B=nn.Parameter(b.to(device)), scaling=scaling
        )


def remove_adapter(model: nn.Module, adapter_id: str) -> None:
    """Drop the adapter from every layer (no-op if absent)."""
    for layer in lora_layers(model):
        layer.adapters.pop(adapter_id, None)


def has_adapter(model: nn.Module, adapter_id: str) -> bool:
    return any(adapter_id in layer.adapters for layer in lora_layers(model))


def adapter_parameters(model: nn.Module, adapter_id: str) -> dict[str, nn.Parameter]:
    """The adapter's parameters in module order, keyed by their PEFT names."""
    params: dict[str, nn.Parameter] = {}
    for layer in lora_layers(model):
        w = layer.adapters.get(adapter_id)
        if w is not None:
            params[layer.peft_key("A")] = w.A
            params[layer.peft_key("B")] = w.B
    if not params:
        raise KeyError(adapter_id)
    return params


# ----------------------------------------------------------------------------------- PEFT files


def save_adapter(
    model: nn.Module,
    adapter_id: str,
    spec: LoraSpec,
    directory: str | Path,
    base_model_name: str = "",
    seal: Sealer = plain,
) -> list[Path]:
    """Write the PEFT files of one adapter into an existing ``directory`` (through ``seal``:
    engine/backends/age_seal.py); returns their paths."""
    params = adapter_parameters(model, adapter_id)
    used = sorted(
        {layer.target_name for layer in lora_layers(model) if adapter_id in layer.adapters}
    )
    return write_adapter_files(directory, params, spec, used, base_model_name, seal)


def load_adapter_weights(model: nn.Module, adapter_id: str, directory: str | Path) -> None:
    """Copy ``adapter_model.safetensors`` into an existing adapter of matching shape (every name
    and shape is checked first, so a bad file changes nothing)."""
    params = adapter_parameters(model, adapter_id)
    tensors = read_adapter_tensors(directory, {k: tuple(p.shape) for k, p in params.items()})
    with torch.no_grad():
        for key, p in params.items():
            p.copy_(tensors[key].to(p.dtype))


def load_adapter(
    model: nn.Module, adapter_id: str, directory: str | Path, seed: int = 0
) -> LoraSpec:
    """Add adapter ``adapter_id`` from PEFT files in ``directory``; nothing is left on failure."""
    spec = read_adapter_config(directory, seed=seed)
    add_adapter(model, adapter_id, spec)
    try:
        load_adapter_weights(model, adapter_id, directory)
    except BaseException:
        remove_adapter(model, adapter_id)
        raise
    return spec
