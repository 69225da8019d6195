"""Many tenants' LoRA adapters on one frozen megatron-core GPTModel stage, as forward hooks.

Owns the adapters of this rank (PEFT layout, TP-sharded), their seeded init, row routing and the
gather/scatter between these shards and full PEFT tensors (checkpoints, optimizer state).

Why hooks, not wrapper modules: megatron reaches into ``linear_qkv``/``output_layer`` (weights,
``sequence_parallel``, ``backward_dw``); a forward hook on each leaves the module, its attributes
and the base ``state_dict`` untouched. Adapters stay outside the module tree (plain dicts of
parameters), as in engine/backends/lora.py, so each adapter's optimizer owns only its tensors.

Sharding (what a rank holds; always PEFT matrices, never fused ones):
- column-parallel bases (q/k/v in ``linear_qkv``, gate/up in ``linear_fc1``, lm_head in
  ``output_layer``): A replicated ``[r, in]``, B = this rank's rows ``[out/tp, r]``; the delta is
  ``copy_to_tp_region(x Aᵀ) B_localᵀ`` (backward all-reduces the small ``tokens × r`` gradient,
  so A's gradient is the same on every TP rank);
- row-parallel bases (o_proj, down_proj): A = this rank's columns ``[r, in/tp]``, B replicated;
  the delta is ``reduce_from_tp_region(x_local A_localᵀ) Bᵀ``.
A is replicated for column layers (not split along r, as Megatron-Bridge does) because tenant
ranks (1…1024) need not divide TP. q, k and v keep their own (A, B) and their deltas are
interleaved per local KV group like the base weight; gate and up likewise: any PEFT adapter
(even one with different q/k/v A matrices) loads exactly, and checkpoints equal the Transformers
backend's.

Routing: segments ``(adapter_id, start, end)`` on the batch dimension, which is dim 1 in
megatron's ``[seq, batch, hidden]`` activations. Rows outside every segment see the base model
(``disable_lora``, DPO reference passes). The base GEMM runs once; LoRA per segment.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from engine.backends.lora import PEFT_PREFIX, row_chunks, target_module_names
from engine.backends.megatron.arch import Arch
from engine.protocol import LoraSpec

Segment = tuple[str, int, int]
_ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP = ("gate_proj", "up_proj", "down_proj")


@dataclass
class _Site:
    """One megatron linear and the PEFT targets it hosts."""

    module: nn.Module
    kind: str  # "qkv" | "fc1" | "row" | "head"
    hf_prefix: str  # "model.layers.3.self_attn." ("" for lm_head)
    parts: tuple[str, ...]
    adapters: dict[str, dict[str, tuple[nn.Parameter, nn.Parameter]]] = field(default_factory=dict)
    scaling: dict[str, float] = field(default_factory=dict)

    @property
    def row_parallel(self) -> bool:
        return self.kind == "row"

    def hf_name(self, part: str) -> str:
        return "lm_head" if part == "lm_head" else self.hf_prefix + part


def _tp() -> tuple[int, int]:
    from megatron.core import parallel_state as ps

    return ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()


class MegatronMultiLora:
    """The adapters of one rank's GPTModel stage (``model``) of a model with ``arch``."""

    def __init__(self, model: nn.Module, arch: Arch, *, pp_rank: int = 0, pp: int = 1) -> None:
        self.model, self.arch = model, arch
        self.segments: tuple[Segment, ...] = ()
        per_stage = arch.num_layers // pp
        self.offset = pp_rank * per_stage
        self.sites: list[_Site] = []
        decoder: Any = model.decoder
        for local, layer in enumerate(decoder.layers):
            p = f"model.layers.{self.offset + local}."
            att, mlp = layer.self_attention, layer.mlp
            self.sites += [
                _Site(att.linear_qkv, "qkv", p + "self_attn.", ("q_proj", "k_proj", "v_proj")),
                _Site(att.linear_proj, "row", p + "self_attn.", ("o_proj",)),
                _Site(mlp.linear_fc1, "fc1", p + "mlp.", ("gate_proj", "up_proj")),
                _Site(mlp.linear_fc2, "row", p + "mlp.", ("down_proj",)),
            ]
        if getattr(model, "post_process", False):
            self.sites.append(_Site(model.output_layer, "head", "", ("lm_head",)))  # type: ignore[arg-type]
        self._by_name = {s.hf_name(part): (s, part) for s in self.sites for part in s.parts}
        for s in self.sites:
            s.module.register_forward_hook(self._hook(s), with_kwargs=True)

    # ----------------------------------------------------------------------------- adapters

    def _full_shape(self, part: str) -> tuple[int, int]:
        a = self.arch
        h, d = a.hidden_size, a.head_dim
        return {
            "q_proj": (a.num_heads * d, h),
            "k_proj": (a.num_kv_groups * d, h),
            "v_proj": (a.num_kv_groups * d, h),
            "o_proj": (h, a.num_heads * d),
            "gate_proj": (a.ffn_hidden_size, h),
            "up_proj": (a.ffn_hidden_size, h),
            "down_proj": (h, a.ffn_hidden_size),
            "lm_head": (a.vocab_size, h),
        }[part]

    def hf_order(self) -> Iterator[str]:
        """Every HF module name an adapter can target, in HF module order over the whole model
        (all pipeline stages): the order engine/backends/lora.py draws A matrices in."""
        for layer in range(self.arch.num_layers):
            yield from (f"model.layers.{layer}.self_attn.{p}" for p in _ATTN)
            yield from (f"model.layers.{layer}.mlp.{p}" for p in _MLP)
        yield "lm_head"

    def full_shapes(self, spec: LoraSpec) -> dict[str, tuple[int, int]]:
        """PEFT name → full (unsharded) shape of every tensor an adapter with ``spec`` has over
        the whole model, in HF module order: the contents of its ``adapter_model.safetensors``."""
        targets = set(target_module_names(spec))
        out: dict[str, tuple[int, int]] = {}
        for name in self.hf_order():
            part = name.rsplit(".", 1)[-1]
            if part in targets:
                out_f, in_f = self._full_shape(part)
                out[f"{PEFT_PREFIX}{name}.lora_A.weight"] = (spec.rank, in_f)
                out[f"{PEFT_PREFIX}{name}.lora_B.weight"] = (out_f, spec.rank)
        return out

    def full_names(self, spec: LoraSpec) -> list[str]:
        return list(self.full_shapes(spec))

    def has_adapter(self, adapter_id: str) -> bool:
        return any(adapter_id in s.adapters for s in self.sites)

    def add_adapter(self, adapter_id: str, spec: LoraSpec, *, device=None) -> None:
        """A fresh adapter, bit-identical to lora.add_adapter on the HF model: A drawn with
        kaiming_uniform(a=√5) from one generator seeded with ``spec.seed`` in HF module order,
        B = 0. Every rank draws every A (other stages' too) so the generator stays in step, then
        keeps its own slice."""
        targets = set(target_module_names(spec))
        gen = torch.Generator(device="cpu").manual_seed(int(spec.seed))
        scaling = float(spec.alpha) / int(spec.rank)
        for name in self.hf_order():
            part = name.rsplit(".", 1)[-1]
            if part not in targets:
                continue
            out_f, in_f = self._full_shape(part)
            a = torch.empty(spec.rank, in_f, dtype=torch.float32)
            nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=gen)
            hit = self._by_name.get(name)
            if hit is None:  # the layer lives on another pipeline stage
                continue
            site, _ = hit
            b = torch.zeros(out_f, spec.rank, dtype=torch.float32)
            A = nn.Parameter(self.shard(f"{PEFT_PREFIX}{name}.lora_A.weight", a).to(device))
            B = nn.Parameter(self.shard(f"{PEFT_PREFIX}{name}.lora_B.weight", b).to(device))
            site.adapters.setdefault(adapter_id, {})[part] = (A, B)
            site.scaling[adapter_id] = scaling

    def remove_adapter(self, adapter_id: str) -> None:
        for s in self.sites:
            s.adapters.pop(adapter_id, None)
            s.scaling.pop(adapter_id, None)

    def parameters(self, adapter_id: str) -> dict[str, nn.Parameter]:
        """PEFT name → this rank's parameter (a shard or a replica), in HF module order."""
        out: dict[str, nn.Parameter] = {}
        for s in self.sites:
            for part, (A, B) in s.adapters.get(adapter_id, {}).items():
                base = PEFT_PREFIX + s.hf_name(part)
                out[base + ".lora_A.weight"] = A
                out[base + ".lora_B.weight"] = B
        return out

    def _split_dim(self, peft_name: str) -> int | None:
        """The dim a PEFT tensor is split over TP on (None: replicated on every TP rank)."""
        short = peft_name[len(PEFT_PREFIX) :].rsplit(".lora_", 1)
        site, _ = self._by_name[short[0]]
        is_a = short[1].startswith("A")
        if site.row_parallel:
            return 1 if is_a else None
        return None if is_a else 0

    def is_sharded(self, peft_name: str) -> bool:
        return self._split_dim(peft_name) is not None

    def shard(self, peft_name: str, full: torch.Tensor) -> torch.Tensor:
        """This rank's part of a full PEFT tensor (an A/B matrix or its optimizer moment)."""
        rank, size = _tp()
        dim = self._split_dim(peft_name)
        if dim is None or size == 1:
            return full.clone()
        return full.chunk(size, dim=dim)[rank].contiguous()

    def gather(self, local: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Full PEFT tensors from this stage's shards (collective over the TP group; every TP
        rank gets the result). Pipeline stages are merged by the caller (`gather_stages`)."""
        from megatron.core import parallel_state as ps

        rank, size = _tp()
        out: dict[str, torch.Tensor] = {}
        for name, t in local.items():
            dim = self._split_dim(name)
            t = t.detach()
            if dim is None or size == 1:
                out[name] = t.clone()
                continue
            parts = [torch.empty_like(t) for _ in range(size)]
            torch.distributed.all_gather(
                parts, t.contiguous(), group=ps.get_tensor_model_parallel_group()
            )
            out[name] = torch.cat(parts, dim=dim)
        del rank
        return out

    # ----------------------------------------------------------------------------- forward

    @contextlib.contextmanager
    def routing(self, segments: Sequence[Segment]) -> Iterator[None]:
        prev, self.segments = self.segments, tuple(segments)
        try:
            yield
        finally:
            self.segments = prev

    def _delta(self, site: _Site, adapter_id: str, x: torch.Tensor) -> torch.Tensor:
        from megatron.core import tensor_parallel as tpl

        ad, sc = site.adapters[adapter_id], site.scaling[adapter_id]
        if site.row_parallel:
            A, B = ad[site.parts[0]]
            h = tpl.reduce_from_tensor_model_parallel_region(F.linear(x.to(A.dtype), A))
            return F.linear(h * sc, B)  # scaled at rank r, not at the full output width
        outs = {}
        for part, (A, B) in ad.items():
            h = tpl.copy_to_tensor_model_parallel_region(F.linear(x.to(A.dtype), A))
            outs[part] = F.linear(h * sc, B)
        lead = x.shape[:-1]
        if site.kind == "head":
            return outs["lm_head"]
        _, tp = _tp()
        a = self.arch
        zero = x.new_zeros((), dtype=torch.float32)
        if site.kind == "qkv":  # interleave per local KV group, like the base weight
            G, d = a.num_kv_groups // tp, a.head_dim
            hpg = a.num_heads // a.num_kv_groups
            q = outs.get("q_proj", zero.expand(*lead, G * hpg * d)).reshape(*lead, G, hpg * d)
            k = outs.get("k_proj", zero.expand(*lead, G * d)).reshape(*lead, G, d)
            v = outs.get("v_proj", zero.expand(*lead, G * d)).reshape(*lead, G, d)
            return torch.cat([q, k, v], dim=-1).reshape(*lead, -1)
        n = a.ffn_hidden_size // tp  # fc1: [gate rows of this rank ; up rows of this rank]
        gate = outs.get("gate_proj", zero.expand(*lead, n))
        up = outs.get("up_proj", zero.expand(*lead, n))
        return torch.cat([gate, up], dim=-1)

    def _hook(self, site: _Site):
        def hook(module, args, kwargs, output):
            segments = self.segments
            if not segments or not site.adapters:
                return output
            out, bias = output
            x = args[0] if args else kwargs["input_"]
            # megatron's activations are [seq, batch, hidden]: segments are on dim 1
            found = lambda a: a if a in site.adapters else None  # noqa: E731
            chunks = row_chunks(segments, x.shape[1], found)
            if not chunks:
                return output
            # torch.cat and out + ..., not an in-place add: `out` is needed by autograd. split,
            # not x[:, start:end]: each slice's backward zero-fills a full-size gradient.
            only = chunks[0][1] if len(chunks) == 1 else None
            if only is not None:  # one adapter over the whole batch
                return out + self._delta(site, only, x).to(out.dtype), bias
            pieces = [
                out.new_zeros(out.shape[0], rows, *out.shape[2:])
                if aid is None
                else self._delta(site, aid, xi).to(out.dtype)
                for xi, (rows, aid) in zip(
                    x.split([rows for rows, _ in chunks], dim=1), chunks, strict=True
                )
            ]
            return out + torch.cat(pieces, dim=1), bias

        return hook
