"""The HF → megatron-core weight mapping (engine/backends/megatron/mapping.py) is exact.

Five tiny random float32 models built in this process with transformers (hidden 64, 4 heads,
2 KV groups, 2 layers, vocabulary 256, norms and biases randomised so that they are neither ones
nor zeros): Qwen2 tied and untied (QKV bias), Llama without RoPE scaling, Llama with llama3
scaling (factor 8) and Qwen3 with q/k norms and head_dim 32 != hidden/heads. For each:

1. the world-1 GPTModel's logits equal transformers' within 1e-5 x max(1, max|logit|);
2. `hf_to_mcore` yields exactly the GPTModel's weight keys, and reads every HF tensor (for a tied
   model ``lm_head.weight`` may stay unread);
3. the gradient of every base parameter (both models unfrozen, one fixed scalar of the logits)
   equals the HF gradient mapped through `hf_to_mcore` (the mapping is a linear re-layout) within
   1e-5 of the largest entry;
4. negative controls fail the tolerance: Q/K/V concatenated without the per-group interleave, and
   (llama3 case) the same weights without RoPE scaling, which the sequence length makes matter;
5. the TP=2 / PP=2 / TP=2xPP=2 shards, computed without processes, reassemble into the world-1
   tensors (QKV rows by whole KV groups, fc1 as [gate_r ; up_r] per rank, linear_proj/fc2
   columns, embedding/output rows), and stage s holds HF layers s·L/pp onwards;
6. `TensorReader.from_dir` on a ``save_pretrained`` folder reads what `from_dict` reads, whole and
   sliced, and refuses a folder without safetensors with a ConfigError naming it.

Measured (2 CPU cores, 2026-12-04; whole file ~6 s after imports): logits max|diff| /
max(1, max|logit|) 7.0e-7 qwen2_tied, 6.1e-7 qwen2_untied, 6.2e-7 llama, 5.6e-7 llama3_scaled,
6.7e-7 qwen3_qknorm (max|logit| 3.0-3.6); gradients at most 1.5e-6 of the largest entry; the plain
QKV concatenation errs by 4.1-5.1 (> 1 x max|logit|) and dropping the RoPE scaling by 1.4e-2
(~400 x the tolerance).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("megatron.core")

from engine.backends.megatron import compat  # noqa: E402
from engine.backends.megatron.arch import Arch, arch_from_hf_config, read_arch  # noqa: E402
from engine.backends.megatron.mapping import TensorReader, hf_to_mcore, load_into  # noqa: E402
from engine.backends.megatron.model import build_gpt, causal_mask, load_base  # noqa: E402
from engine.errors import ConfigError  # noqa: E402

# 24 positions: at position 23 the llama3 case's lowest frequency (wavelength 2π·10^3.5 > 8192,
# divided by 8) turns 6.4e-3 rad less than unscaled, which moves the logits by ~1e-2
B, T = 2, 24
TOL = 1e-5
SHAPE = {
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "initializer_range": 0.1,  # logits of a few units, so that layout errors are visible
    "rms_norm_eps": 1e-6,
}
LLAMA3 = {
    "rope_type": "llama3",
    # theta 1e4 with head_dim 16: wavelengths 2π·10^(i/2), i < 8, span the three llama3 bands
    # (< 2048 kept, 2048..8192 smoothed, > 8192 divided by the factor)
    "rope_theta": 10000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def _configs() -> dict[str, Callable[[], tuple[Any, type]]]:
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    def qwen2(tied: bool):
        return lambda: (
            Qwen2Config(**SHAPE, tie_word_embeddings=tied, architectures=["Qwen2ForCausalLM"]),
            Qwen2ForCausalLM,
        )

    def llama(rope: dict[str, Any]):
        return lambda: (
            LlamaConfig(
                **SHAPE,
                tie_word_embeddings=False,
                max_position_embeddings=131072,
                rope_parameters=rope,
                architectures=["LlamaForCausalLM"],
            ),
            LlamaForCausalLM,
        )

    return {
        "qwen2_tied": qwen2(True),
        "qwen2_untied": qwen2(False),
        "llama": llama({"rope_type": "default", "rope_theta": 500000.0}),
        "llama3_scaled": llama(LLAMA3),
        "qwen3_qknorm": lambda: (
            Qwen3Config(
                **SHAPE,
                head_dim=32,
                tie_word_embeddings=False,
                architectures=["Qwen3ForCausalLM"],
            ),
            Qwen3ForCausalLM,
        ),
    }


CASES = ["qwen2_tied", "qwen2_untied", "llama", "llama3_scaled", "qwen3_qknorm"]


@dataclasses.dataclass
class Case:
    name: str
    hf: torch.nn.Module
    cfg: dict[str, Any]
    state: dict[str, torch.Tensor]
    arch: Arch
    ids: torch.Tensor
    pos: torch.Tensor
    ref: torch.Tensor  # HF logits [B, T, V]

    @property
    def tol(self) -> float:
        return TOL * max(1.0, float(self.ref.abs().max()))


def _mcore_logits(model: torch.nn.Module, case: Case) -> torch.Tensor:
    return model(case.ids, case.pos, attention_mask=causal_mask(case.ids.shape[1]))


@pytest.fixture(scope="module", params=CASES)
def case(request: pytest.FixtureRequest) -> Case:
    compat.init_parallel(1, 1)  # idempotent at world 1; other megatron tests use the same sizes
    config, cls = _configs()[request.param]()
    torch.manual_seed(0)
    hf = cls(config).float().eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:  # ones at init
                p.add_(torch.randn(p.shape, generator=gen) * 0.2)
            elif name.endswith(".bias"):  # zeros at init
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    cfg = hf.config.to_dict()
    ids = torch.randint(0, SHAPE["vocab_size"], (B, T), generator=gen)
    with torch.no_grad():
        ref = hf(input_ids=ids).logits
    return Case(
        name=request.param,
        hf=hf,
        cfg=cfg,
        state={k: v.detach().clone() for k, v in hf.state_dict().items()},
        arch=arch_from_hf_config(cfg),
        ids=ids,
        pos=torch.arange(T)[None].expand(B, T),
        ref=ref,
    )


def _err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out - ref).abs().max())


# ----------------------------------------------------------------------------- 1. logits


def test_arch_reads_the_config(case: Case) -> None:
    a = case.arch
    assert a.tied == (case.name == "qwen2_tied")
    assert a.qkv_bias == case.name.startswith("qwen2")
    assert a.qk_norm == (case.name == "qwen3_qknorm")
    assert a.head_dim == (32 if case.name == "qwen3_qknorm" else 16)
    assert a.rope_scaling_factor == (8.0 if case.name == "llama3_scaled" else None)
    assert (a.num_heads, a.num_kv_groups, a.num_layers) == (4, 2, 2)


def test_logits_match_transformers(case: Case) -> None:
    model = load_base(TensorReader.from_dict(case.state), case.arch)
    with torch.no_grad():
        out = _mcore_logits(model, case)
    assert out.shape == case.ref.shape
    err = _err(out, case.ref)
    print(f"{case.name}: max|diff| {err:.2e}, max|logit| {float(case.ref.abs().max()):.2f}")
    assert float(case.ref.abs().max()) > 1.0  # the weights are not trivially small
    assert err <= case.tol, (case.name, err)


# ----------------------------------------------------------------------------- 2. coverage


def _recording(state: dict[str, torch.Tensor]) -> tuple[TensorReader, set[str]]:
    inner = TensorReader.from_dict(state)
    seen: set[str] = set()

    def read(name: str, dim: int, start: int, stop: int) -> torch.Tensor:
        seen.add(name)
        return inner._read(name, dim, start, stop)

    return TensorReader(inner.names, read), seen


def test_mapping_covers_every_weight_both_ways(case: Case) -> None:
    reader, seen = _recording(case.state)
    state = hf_to_mcore(reader, case.arch)
    model = build_gpt(case.arch, 1, 1)
    weights = {k for k in model.state_dict() if not k.endswith("_extra_state")}
    assert set(state) == weights
    assert weights == {k for k, _ in model.named_parameters()}
    for k, v in model.state_dict().items():
        if k in state:
            assert state[k].shape == v.shape, k
    unread = set(case.state) - seen
    assert unread == ({"lm_head.weight"} if case.arch.tied else set()), unread
    assert ("output_layer.weight" in state) == (not case.arch.tied)


def test_load_into_is_strict(case: Case) -> None:
    model = build_gpt(case.arch, 1, 1)
    state = hf_to_mcore(TensorReader.from_dict(case.state), case.arch)
    missing = dict(state)
    missing.pop("decoder.final_layernorm.weight")
    with pytest.raises(ConfigError, match="missing"):
        load_into(model, missing)
    with pytest.raises(ConfigError, match="unexpected"):
        load_into(model, {**state, "decoder.layers.9.mlp.linear_fc1.weight": torch.zeros(1)})
    key = "decoder.layers.0.mlp.linear_fc2.weight"
    with pytest.raises(ConfigError, match="shape"):
        load_into(model, {**state, key: state[key].t().contiguous()})


# ----------------------------------------------------------------------------- 3. gradients


def test_gradients_match_transformers(case: Case) -> None:
    model = build_gpt(case.arch, 1, 1)
    load_into(model, hf_to_mcore(TensorReader.from_dict(case.state), case.arch))
    model.eval()
    weights = torch.randn(case.ref.shape, generator=torch.Generator().manual_seed(2))
    hf = case.hf
    hf.zero_grad(set_to_none=True)
    hf.requires_grad_(True)
    try:
        (hf(input_ids=case.ids).logits * weights).sum().backward()
        hf_grads = {n: p.grad.detach().clone() for n, p in hf.named_parameters()}
    finally:
        hf.zero_grad(set_to_none=True)
    assert all(g is not None for g in hf_grads.values())
    (_mcore_logits(model, case) * weights).sum().backward()
    want = hf_to_mcore(TensorReader.from_dict(hf_grads), case.arch)
    got = {n: p.grad for n, p in model.named_parameters()}
    assert set(got) == set(want)
    worst = 0.0
    for name, g in got.items():
        assert g is not None, name
        scale = float(want[name].abs().max())
        assert scale > 0, name
        rel = _err(g, want[name]) / scale
        worst = max(worst, rel)
        assert rel <= TOL, (case.name, name, rel)
    print(f"{case.name}: worst gradient diff {worst:.1e} of the largest entry")


# ----------------------------------------------------------------------------- 4. negative controls


def test_plain_qkv_concatenation_fails(case: Case) -> None:
    """[all q ; all k ; all v] instead of per-group [q_g ; k_g ; v_g]: the check must notice."""
    state = hf_to_mcore(TensorReader.from_dict(case.state), case.arch)
    for layer in range(case.arch.num_layers):
        a = f"model.layers.{layer}.self_attn."
        for suffix in ("weight", "bias") if case.arch.qkv_bias else ("weight",):
            key = f"decoder.layers.{layer}.self_attention.linear_qkv.{suffix}"
            plain = torch.cat([case.state[f"{a}{p}_proj.{suffix}"] for p in "qkv"])
            assert plain.shape == state[key].shape
            assert not torch.equal(plain, state[key])
            state[key] = plain
    model = build_gpt(case.arch, 1, 1)
    load_into(model, state)
    model.eval()
    with torch.no_grad():
        err = _err(_mcore_logits(model, case), case.ref)
    print(f"{case.name}: plain QKV concatenation errs by {err:.2e}")
    assert err > 100 * case.tol, (case.name, err)


def test_rope_scaling_matters(case: Case) -> None:
    """The llama3 case would fail if the scaling were dropped (and its reference differs from the
    unscaled model's), so test 1 does check that the scaling is reproduced."""
    if case.arch.rope_scaling_factor is None:
        pytest.skip("no RoPE scaling in this case")
    unscaled = dataclasses.replace(case.arch, rope_scaling_factor=None)
    model = load_base(TensorReader.from_dict(case.state), unscaled)
    with torch.no_grad():
        err = _err(_mcore_logits(model, case), case.ref)
    print(f"{case.name}: without RoPE scaling errs by {err:.2e}")
    assert err > 100 * case.tol, err


# ----------------------------------------------------------------------------- 5. TP / PP slices


def _reassemble(
    shards: dict[tuple[int, int], dict[str, torch.Tensor]], arch: Arch, tp: int, pp: int
) -> dict[str, torch.Tensor]:
    """The world-1 state dict from every (pp_rank, tp_rank) shard, by the documented splits."""
    out: dict[str, torch.Tensor] = {}
    per_stage = arch.num_layers // pp
    for s in range(pp):
        parts = [shards[(s, r)] for r in range(tp)]
        assert all(set(p) == set(parts[0]) for p in parts)
        for key in parts[0]:
            ts = [p[key] for p in parts]
            if key.endswith(("linear_qkv.weight", "linear_qkv.bias")):
                # whole KV groups per rank, in group order
                full = torch.cat(ts, dim=0)
                group = (arch.num_heads // arch.num_kv_groups + 2) * arch.head_dim
                assert ts[0].shape[0] == arch.num_kv_groups // tp * group
            elif key.endswith("linear_fc1.weight"):
                # each rank [gate_r ; up_r]: world 1 is [gate ; up]
                half = [t.view(2, -1, arch.hidden_size) for t in ts]
                full = torch.cat(half, dim=1).reshape(-1, arch.hidden_size)
            elif key.endswith(("linear_proj.weight", "linear_fc2.weight")):
                full = torch.cat(ts, dim=1)
            elif key in ("embedding.word_embeddings.weight", "output_layer.weight"):
                full = torch.cat(ts, dim=0)
                assert ts[0].shape[0] == arch.vocab_size // tp
            else:  # norms: replicated
                assert "layernorm" in key, key
                assert all(torch.equal(t, ts[0]) for t in ts), key
                full = ts[0]
            if key.startswith("decoder.layers."):
                local, rest = key.removeprefix("decoder.layers.").split(".", 1)
                key = f"decoder.layers.{s * per_stage + int(local)}.{rest}"
            assert key not in out, key
            out[key] = full
    return out


@pytest.mark.parametrize(("tp", "pp"), [(2, 1), (1, 2), (2, 2)])
def test_tp_pp_shards_reassemble(case: Case, tp: int, pp: int) -> None:
    reader = TensorReader.from_dict(case.state)
    world1 = hf_to_mcore(reader, case.arch)
    arch = arch_from_hf_config(case.cfg, tp=tp, pp=pp)
    assert arch == case.arch  # the sizes are only validated
    shards = {
        (s, r): hf_to_mcore(reader, arch, tp_rank=r, tp=tp, pp_rank=s, pp=pp)
        for s in range(pp)
        for r in range(tp)
    }
    first, last = shards[(0, 0)], shards[(pp - 1, 0)]
    assert ("embedding.word_embeddings.weight" in shards[(pp - 1, 0)]) == (pp == 1)
    assert ("decoder.final_layernorm.weight" in first) == (pp == 1)
    # tied on one stage: the output layer is the embedding; across stages: a copy of it
    assert ("output_layer.weight" in last) == (not case.arch.tied or pp > 1)
    if pp > 1:
        assert "output_layer.weight" not in first
        head = "model.embed_tokens.weight" if case.arch.tied else "lm_head.weight"
        rows = case.arch.vocab_size // tp
        for r in range(tp):
            got = shards[(pp - 1, r)]["output_layer.weight"]
            assert torch.equal(got, case.state[head][r * rows : (r + 1) * rows])
        # stage 1's layer 0 is HF layer layers/pp
        q = case.state[f"model.layers.{case.arch.num_layers // pp}.input_layernorm.weight"]
        assert torch.equal(shards[(1, 0)]["decoder.layers.0.input_layernorm.weight"], q)
    whole = _reassemble(shards, arch, tp, pp)
    if case.arch.tied and pp > 1:
        whole.pop("output_layer.weight")
    assert set(whole) == set(world1)
    for key, t in world1.items():
        assert torch.equal(whole[key], t), key


def test_tp_shard_contents(case: Case) -> None:
    """Rank 1 of TP=2, from the HF names directly: its KV group, its gate/up rows, its columns."""
    arch = arch_from_hf_config(case.cfg, tp=2)
    s = hf_to_mcore(TensorReader.from_dict(case.state), arch, tp_rank=1, tp=2)
    hf, d = case.state, arch.head_dim
    p, m = "model.layers.1.", "decoder.layers.1."
    f = arch.ffn_hidden_size // 2
    q_rows = arch.num_heads // 2 * d  # rank 1 holds KV group 1 and its query heads
    want_qkv = torch.cat(
        [
            hf[p + "self_attn.q_proj.weight"][q_rows:],
            hf[p + "self_attn.k_proj.weight"][d:],
            hf[p + "self_attn.v_proj.weight"][d:],
        ]
    )
    assert torch.equal(s[m + "self_attention.linear_qkv.weight"], want_qkv)
    want_fc1 = torch.cat([hf[p + "mlp.gate_proj.weight"][f:], hf[p + "mlp.up_proj.weight"][f:]])
    assert torch.equal(s[m + "mlp.linear_fc1.weight"], want_fc1)
    assert torch.equal(s[m + "mlp.linear_fc2.weight"], hf[p + "mlp.down_proj.weight"][:, f:])
    o = hf[p + "self_attn.o_proj.weight"]
    assert torch.equal(s[m + "self_attention.linear_proj.weight"], o[:, q_rows:])
    v = arch.vocab_size // 2
    embed = hf["model.embed_tokens.weight"]
    assert torch.equal(s["embedding.word_embeddings.weight"], embed[v:])


def test_bad_parallel_sizes_are_refused(case: Case) -> None:
    with pytest.raises(ConfigError, match="num_key_value_heads"):
        arch_from_hf_config(case.cfg, tp=4)  # 2 KV groups
    with pytest.raises(ConfigError, match="num_hidden_layers"):
        arch_from_hf_config(case.cfg, pp=3)


# ----------------------------------------------------------------------------- 6. from_dir


def test_from_dir_reads_what_from_dict_reads(case: Case, tmp_path: Path) -> None:
    case.hf.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").is_file()
    disk, mem = TensorReader.from_dir(tmp_path), TensorReader.from_dict(case.state)
    assert disk.names <= mem.names
    assert mem.names - disk.names <= {"lm_head.weight"}  # tied: not saved
    for name in disk.names:
        t = mem.full(name)
        assert torch.equal(disk.full(name), t), name
        assert torch.equal(disk.rows(name, 1, 3), t[1:3]), name
        if t.dim() == 2:
            assert torch.equal(disk.cols(name, 2, 5), t[:, 2:5]), name
    assert read_arch(tmp_path) == case.arch
    for tp_rank in (0, 1):
        arch = arch_from_hf_config(case.cfg, tp=2, pp=2)
        a = hf_to_mcore(disk, arch, tp_rank=tp_rank, tp=2, pp_rank=1, pp=2)
        b = hf_to_mcore(mem, arch, tp_rank=tp_rank, tp=2, pp_rank=1, pp=2)
        assert set(a) == set(b)
        for key in a:
            assert torch.equal(a[key], b[key]), key


def test_from_dir_without_safetensors_names_the_folder(tmp_path: Path) -> None:
    folder = tmp_path / "no-weights"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    (folder / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(ConfigError, match="safetensors") as info:
        TensorReader.from_dir(folder)
    assert str(folder) in str(info.value)
