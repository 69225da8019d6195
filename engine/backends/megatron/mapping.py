"""Hugging Face Qwen2 / Qwen3 / Llama weights → megatron-core GPTModel (local spec), per rank.

Owns the layout (checked numerically against transformers, shared/docs/megatron §2):

  embedding.word_embeddings.weight          ← model.embed_tokens.weight          (vocab rows / TP)
  decoder.layers.l.input_layernorm.weight   ← model.layers.L.input_layernorm.weight
  decoder.layers.l.self_attention.linear_qkv.weight/.bias
        ← q/k/v_proj interleaved per KV group: [q of the group's heads ; k_g ; v_g]; TP rank r
          holds groups [r·G/tp, (r+1)·G/tp)
  decoder.layers.l.self_attention.{q,k}_layernorm.weight ← self_attn.{q,k}_norm.weight (Qwen3)
  decoder.layers.l.self_attention.linear_proj.weight ← o_proj.weight           (columns / TP)
  decoder.layers.l.pre_mlp_layernorm.weight ← post_attention_layernorm.weight
  decoder.layers.l.mlp.linear_fc1.weight    ← [gate rows of rank r ; up rows of rank r]
  decoder.layers.l.mlp.linear_fc2.weight    ← down_proj.weight                  (columns / TP)
  decoder.final_layernorm.weight            ← model.norm.weight
  output_layer.weight                       ← lm_head.weight, or embed_tokens when tied
                                              (absent when tied on a single stage)

``l`` is the layer's index on this pipeline stage, ``L = pp_rank·layers/pp + l`` the HF index.
Tensors are read through a `TensorReader`, so a rank reads only its own slices of a
safetensors checkpoint (``safe_open(...).get_slice``): no rank materialises the whole model.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch

from engine.backends.megatron.arch import Arch
from engine.errors import ConfigError

#: a read of one HF tensor, optionally only rows [start, stop) of dim ``dim``
Read = Callable[[str, int, int, int], torch.Tensor]


class TensorReader:
    """HF tensors by name, sliced on read. ``from_dict`` for in-memory state dicts (tests, the
    gradient check), ``from_dir`` for a model folder (``model.safetensors`` or a sharded index)."""

    def __init__(self, names: set[str], read: Read) -> None:
        self.names = names
        self._read = read

    def has(self, name: str) -> bool:
        return name in self.names

    def full(self, name: str) -> torch.Tensor:
        return self._read(name, 0, 0, -1)

    def rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        return self._read(name, 0, start, stop)

    def cols(self, name: str, start: int, stop: int) -> torch.Tensor:
        return self._read(name, 1, start, stop)

    @classmethod
    def from_dict(cls, state: dict[str, torch.Tensor]) -> TensorReader:
        def read(name: str, dim: int, start: int, stop: int) -> torch.Tensor:
            t = state[name]
            if stop < 0:
                return t
            return t.narrow(dim, start, stop - start)

        return cls(set(state), read)

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> TensorReader:
        from safetensors import safe_open

        root = Path(model_dir)
        index = root / "model.safetensors.index.json"
        if index.is_file():
            weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        elif (root / "model.safetensors").is_file():
            with safe_open(str(root / "model.safetensors"), framework="pt") as f:
                weight_map = dict.fromkeys(f.keys(), "model.safetensors")  # noqa: SIM118
        else:
            raise ConfigError(
                f"{root}: no model.safetensors (the Megatron backend reads safetensors)"
            )
        handles: dict[str, object] = {}

        def read(name: str, dim: int, start: int, stop: int) -> torch.Tensor:
            file = weight_map[name]
            if file not in handles:
                handles[file] = safe_open(str(root / file), framework="pt")
            sl = handles[file].get_slice(name)  # type: ignore[attr-defined]
            if stop < 0:
                return sl[:]
            return sl[start:stop] if dim == 0 else sl[:, start:stop]

        return cls(set(weight_map), read)


def _chunk(n: int, rank: int, size: int) -> tuple[int, int]:
    per = n // size
    return rank * per, (rank + 1) * per


def _qkv(reader: TensorReader, prefix: str, suffix: str, arch: Arch, tp_rank: int, tp: int):
    """This rank's interleaved QKV weight (suffix 'weight') or bias ('bias')."""
    G, d = arch.num_kv_groups, arch.head_dim
    hpg = arch.num_heads // G
    g0, g1 = _chunk(G, tp_rank, tp)
    q = reader.rows(f"{prefix}q_proj.{suffix}", g0 * hpg * d, g1 * hpg * d)
    k = reader.rows(f"{prefix}k_proj.{suffix}", g0 * d, g1 * d)
    v = reader.rows(f"{prefix}v_proj.{suffix}", g0 * d, g1 * d)
    n = g1 - g0
    tail = q.shape[1:]
    parts = [q.reshape(n, hpg * d, *tail), k.reshape(n, d, *tail), v.reshape(n, d, *tail)]
    return torch.cat(parts, dim=1).reshape(-1, *tail)


def hf_to_mcore(
    reader: TensorReader,
    arch: Arch,
    *,
    tp_rank: int = 0,
    tp: int = 1,
    pp_rank: int = 0,
    pp: int = 1,
) -> dict[str, torch.Tensor]:
    """This rank's GPTModel state dict (plain tensors) from HF tensors."""
    out: dict[str, torch.Tensor] = {}
    per_stage = arch.num_layers // pp
    first, last = pp_rank == 0, pp_rank == pp - 1
    h, ffn, vocab = arch.hidden_size, arch.ffn_hidden_size, arch.vocab_size
    v0, v1 = _chunk(vocab, tp_rank, tp)
    f0, f1 = _chunk(ffn, tp_rank, tp)
    a0, a1 = _chunk(arch.num_heads * arch.head_dim, tp_rank, tp)
    del h
    if first:
        out["embedding.word_embeddings.weight"] = reader.rows("model.embed_tokens.weight", v0, v1)
    for local in range(per_stage):
        L = pp_rank * per_stage + local
        p, m = f"model.layers.{L}.", f"decoder.layers.{local}."
        out[m + "input_layernorm.weight"] = reader.full(p + "input_layernorm.weight")
        out[m + "pre_mlp_layernorm.weight"] = reader.full(p + "post_attention_layernorm.weight")
        a = p + "self_attn."
        out[m + "self_attention.linear_qkv.weight"] = _qkv(reader, a, "weight", arch, tp_rank, tp)
        if arch.qkv_bias:
            out[m + "self_attention.linear_qkv.bias"] = _qkv(reader, a, "bias", arch, tp_rank, tp)
        if arch.qk_norm:
            out[m + "self_attention.q_layernorm.weight"] = reader.full(a + "q_norm.weight")
            out[m + "self_attention.k_layernorm.weight"] = reader.full(a + "k_norm.weight")
        out[m + "self_attention.linear_proj.weight"] = reader.cols(a + "o_proj.weight", a0, a1)
        gate = reader.rows(p + "mlp.gate_proj.weight", f0, f1)
        up = reader.rows(p + "mlp.up_proj.weight", f0, f1)
        out[m + "mlp.linear_fc1.weight"] = torch.cat([gate, up], dim=0)
        out[m + "mlp.linear_fc2.weight"] = reader.cols(p + "mlp.down_proj.weight", f0, f1)
    if last:
        out["decoder.final_layernorm.weight"] = reader.full("model.norm.weight")
        if not (arch.tied and first):  # tied on one stage: the output layer reuses the embedding
            head = "model.embed_tokens.weight"
            if not arch.tied and reader.has("lm_head.weight"):
                head = "lm_head.weight"
            out["output_layer.weight"] = reader.rows(head, v0, v1)
    return out


def load_into(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Copy ``state`` into ``model``; every parameter must be covered and no key left over."""
    own = model.state_dict()
    params = {k for k, _ in model.named_parameters()}
    missing = sorted(params - set(state))
    unexpected = sorted(set(state) - set(own))
    if missing or unexpected:
        raise ConfigError(
            f"Megatron weight mapping: missing {missing[:4]}, unexpected {unexpected[:4]}"
        )
    with torch.no_grad():
        for k, v in state.items():
            if own[k].shape != v.shape:
                raise ConfigError(
                    f"Megatron weight mapping: {k} has shape {tuple(v.shape)}, the model "
                    f"expects {tuple(own[k].shape)}"
                )
            own[k].copy_(v)
