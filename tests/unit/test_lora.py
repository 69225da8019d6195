"""Multi-adapter LoRA: injection, init, routing, gradients, PEFT-format files vs peft itself."""

from __future__ import annotations

import json
import math
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

from engine.backends import lora
from engine.backends.lora import (
    MultiLoraLinear,
    adapter_parameters,
    add_adapter,
    inject_multi_lora,
    load_adapter,
    lora_routing,
    remove_adapter,
    save_adapter,
)
from engine.errors import CheckpointError
from engine.protocol import LoraSpec


def _model(model_dir: Path, dtype=torch.float32):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()


def _perturb(model, adapter_id: str, seed: int, scale: float = 0.05) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in adapter_parameters(model, adapter_id).values():
            p.copy_(torch.randn(p.shape, generator=gen) * scale)


@pytest.fixture()
def model(tiny_model_dir: Path):
    m = _model(tiny_model_dir)
    inject_multi_lora(m)
    return m


def _ids(batch: int = 3, length: int = 12, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 2048, (batch, length), generator=torch.Generator().manual_seed(seed))


def test_injection_wraps_expected_modules_and_keeps_tie(model) -> None:
    wrapped = inject_multi_lora(model)  # idempotent: returns the existing layers
    assert len(wrapped) == 2 * 7 + 1
    assert "lm_head" in wrapped and "model.layers.1.mlp.down_proj" in wrapped
    assert isinstance(model.lm_head, MultiLoraLinear)
    assert model.lm_head.base_layer.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    # adapters live outside the module tree
    add_adapter(model, "a", LoraSpec(rank=4))
    assert not any("lora" in n for n, _ in model.named_parameters())


def test_init_matches_peft_default_and_is_seeded(model) -> None:
    spec = LoraSpec(rank=8, alpha=16.0, seed=7)
    add_adapter(model, "x", spec)
    torch.manual_seed(123)
    torch.rand(1000)  # global RNG state must not matter
    add_adapter(model, "other", LoraSpec(rank=2, seed=99))
    add_adapter(model, "y", spec)
    px, py = adapter_parameters(model, "x"), adapter_parameters(model, "y")
    assert list(px) == list(py)
    for k in px:
        assert torch.equal(px[k], py[k])
        if k.endswith("lora_B.weight"):
            assert torch.count_nonzero(px[k]) == 0
        else:
            bound = 1 / math.sqrt(px[k].shape[1])  # kaiming_uniform_(a=sqrt(5)) on fan_in
            assert px[k].abs().max() <= bound and px[k].abs().max() > 0.8 * bound
    add_adapter(model, "z", LoraSpec(rank=8, alpha=16.0, seed=8))
    k0 = next(iter(px))
    assert not torch.equal(px[k0], adapter_parameters(model, "z")[k0])
    assert k0 == "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    assert px[k0].shape == (8, 64)
    with pytest.raises(ValueError):
        add_adapter(model, "x", spec)


def test_spec_switches_select_modules(model) -> None:
    add_adapter(model, "attn", LoraSpec(rank=2, train_mlp=False, train_unembed=False))
    add_adapter(model, "head", LoraSpec(rank=2, train_attn=False, train_mlp=False))
    attn = {k.split(".")[-3] for k in adapter_parameters(model, "attn")}
    assert attn == {"q_proj", "k_proj", "v_proj", "o_proj"}
    assert list(adapter_parameters(model, "head")) == [
        "base_model.model.lm_head.lora_A.weight",
        "base_model.model.lm_head.lora_B.weight",
    ]


def test_zero_b_is_identity_and_routing_is_per_row(model) -> None:
    # float64: in float32 a 1-row LoRA segment and the whole 3-row batch may take different GEMM
    # blockings, so equal rows could differ by float32 rounding (logits of scale ~10: 1 ulp is
    # ~1e-6); the routing itself is exact, which float64 shows with a wide margin
    model.double()
    x = _ids()
    base = model(x).logits
    add_adapter(model, "a", LoraSpec(rank=4, seed=1))
    with lora_routing(model, [("a", 0, 3)]):
        assert torch.equal(model(x).logits, base)  # B = 0 at init
    add_adapter(model, "b", LoraSpec(rank=8, alpha=8.0, seed=2))
    _perturb(model, "a", 1)
    _perturb(model, "b", 2)
    with lora_routing(model, [("a", 0, 3)]):
        only_a = model(x).logits
    with lora_routing(model, [("b", 0, 3)]):
        only_b = model(x).logits
    with lora_routing(model, [("b", 1, 2), ("a", 0, 1)]):  # unordered; row 2 gets no adapter
        mixed = model(x).logits
    assert (only_a - base).abs().max() > 1e-3 and (only_b - only_a).abs().max() > 1e-3
    torch.testing.assert_close(mixed[0], only_a[0], atol=1e-6, rtol=0)
    torch.testing.assert_close(mixed[1], only_b[1], atol=1e-6, rtol=0)
    torch.testing.assert_close(mixed[2], base[2], atol=1e-6, rtol=0)
    assert torch.equal(model(x).logits, base)  # routing restored on exit
    with pytest.raises(ValueError), lora_routing(model, [("a", 0, 2), ("b", 1, 3)]):
        pass
    remove_adapter(model, "a")
    assert not lora.has_adapter(model, "a") and lora.has_adapter(model, "b")


def test_mixed_batch_gradients_equal_separate_runs(model) -> None:
    # float64: in float32 a 2-row batch and a 1-row batch take different GEMM blockings, which
    # moved single gradient entries of ~0.03 by up to 1.6e-6 (flaky at 1e-6); the routing itself
    # is exact, which float64 shows with a wide margin
    model.double()
    x = _ids(batch=2, length=10, seed=3)
    for name, seed in (("a", 1), ("b", 2)):
        add_adapter(model, name, LoraSpec(rank=4, seed=seed))
        _perturb(model, name, seed)

    def grads(segments, rows):
        for name in ("a", "b"):
            for p in adapter_parameters(model, name).values():
                p.grad = None
        with lora_routing(model, segments):
            logits = model(x[rows]).logits
        torch.log_softmax(logits, -1)[..., 5].sum().backward()
        return {n: {k: p.grad for k, p in adapter_parameters(model, n).items()} for n in ("a", "b")}

    mixed = grads([("a", 0, 1), ("b", 1, 2)], slice(0, 2))
    alone_a = grads([("a", 0, 1)], slice(0, 1))
    alone_b = grads([("b", 0, 1)], slice(1, 2))
    for k, g in mixed["a"].items():
        torch.testing.assert_close(g, alone_a["a"][k], atol=1e-6, rtol=1e-5)
    for k, g in mixed["b"].items():
        torch.testing.assert_close(g, alone_b["b"][k], atol=1e-6, rtol=1e-5)
    assert all(g is None for g in alone_a["b"].values())  # other adapter untouched


def test_matches_float64_merged_weights(tiny_model_dir: Path, model) -> None:
    spec = LoraSpec(rank=4, alpha=8.0, seed=5)
    add_adapter(model, "a", spec)
    _perturb(model, "a", 5)
    x = _ids(batch=2, seed=4)
    with lora_routing(model, [("a", 0, 2)]):
        ours = model(x).logits.double()
    ref = _model(tiny_model_dir, torch.float64)
    ref.lm_head.weight = nn.Parameter(ref.lm_head.weight.detach().clone())  # untie: own delta
    params = adapter_parameters(model, "a")
    for key, a in params.items():
        if key.endswith("lora_A.weight"):
            b = params[key.replace("lora_A", "lora_B")]
            name = key[len("base_model.model.") : -len(".lora_A.weight")]
            with torch.no_grad():
                ref.get_submodule(name).weight += (spec.alpha / spec.rank) * b.double() @ a.double()
    with torch.no_grad():
        expected = ref(x).logits
    torch.testing.assert_close(ours, expected, atol=1e-5, rtol=0)


def test_peft_loads_our_files_with_same_logits(tiny_model_dir: Path, model, tmp_path: Path) -> None:
    from peft import PeftModel

    spec = LoraSpec(rank=4, alpha=8.0, train_mlp=False, seed=3)
    add_adapter(model, "a", spec)
    _perturb(model, "a", 3)
    save_adapter(model, "a", spec, tmp_path, base_model_name="twinkle/tiny-chat")
    cfg = json.loads((tmp_path / "adapter_config.json").read_text())
    assert cfg["r"] == 4 and cfg["lora_alpha"] == 8.0 and cfg["peft_type"] == "LORA"
    assert cfg["target_modules"] == sorted(["q_proj", "k_proj", "v_proj", "o_proj", "lm_head"])
    assert cfg["lora_dropout"] == 0.0 and cfg["bias"] == "none" and cfg["task_type"] == "CAUSAL_LM"
    assert cfg["base_model_name_or_path"] == "twinkle/tiny-chat"

    x = _ids(seed=9)
    with lora_routing(model, [("a", 0, 3)]):
        ours = model(x).logits
    with warnings.catch_warnings():  # peft warns about the tied lm_head; harmless here
        warnings.simplefilter("ignore")
        peft_model = PeftModel.from_pretrained(_model(tiny_model_dir), str(tmp_path)).eval()
    with torch.no_grad():
        theirs = peft_model(x).logits
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=0)


def test_we_load_peft_saved_adapter(tiny_model_dir: Path, model, tmp_path: Path) -> None:
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    pm = get_peft_model(
        _model(tiny_model_dir),
        LoraConfig(
            r=8,
            lora_alpha=16,
            target_modules=[
                "q_proj",
                "k_proj",
                "v_proj",
                "o_proj",
                "gate_proj",
                "up_proj",
                "down_proj",
            ],
            lora_dropout=0.0,
        ),
    ).eval()
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.05)
    pm.save_pretrained(str(tmp_path))
    spec = load_adapter(model, "p", tmp_path)
    assert (spec.rank, spec.alpha, spec.train_attn, spec.train_mlp, spec.train_unembed) == (
        8,
        16.0,
        True,
        True,
        False,
    )
    x = _ids(seed=2)
    with lora_routing(model, [("p", 0, 3)]):
        ours = model(x).logits
    with torch.no_grad():
        theirs = pm(x).logits
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=0)


def test_bad_adapter_files_raise_checkpoint_error(model, tmp_path: Path) -> None:
    spec = LoraSpec(rank=4)
    add_adapter(model, "a", spec)
    save_adapter(model, "a", spec, tmp_path)
    cfg_path = tmp_path / "adapter_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg_path.write_text(json.dumps({**cfg, "r": 8}))  # shapes no longer match
    with pytest.raises(CheckpointError, match="shape"):
        load_adapter(model, "b", tmp_path)
    assert not lora.has_adapter(model, "b")  # nothing left behind
    cfg_path.write_text(json.dumps({**cfg, "use_dora": True}))
    with pytest.raises(CheckpointError, match="use_dora"):
        load_adapter(model, "b", tmp_path)
    cfg_path.write_text(json.dumps({**cfg, "target_modules": ["q_proj"]}))
    with pytest.raises(CheckpointError, match="target_modules"):
        load_adapter(model, "b", tmp_path)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_layer_equals_lora_formula_with_gradients(dtype) -> None:
    # The layer adds each segment's delta inside one addmm (same dtype) or after it (a bfloat16
    # base with float32 adapters); both must equal base(x) + B(A(x)) * alpha / r, and so must
    # the gradients, with rows outside every segment left at the base output.
    torch.manual_seed(0)
    base = nn.Linear(16, 12, bias=True).to(dtype)
    router = lora._Router()
    layer = MultiLoraLinear(base, router, "model.layers.0.self_attn.q_proj")
    weights = lora.LoraWeights(
        A=nn.Parameter(
            torch.randn(4, 16, dtype=torch.float64 if dtype == torch.float64 else torch.float32)
        ),
        B=nn.Parameter(
            torch.randn(12, 4, dtype=torch.float64 if dtype == torch.float64 else torch.float32)
        ),
        scaling=0.5,
    )
    layer.adapters["a"] = weights
    x = torch.randn(5, 3, 16, dtype=dtype, requires_grad=True)
    router.segments = (("a", 1, 4),)
    out = layer(x)
    out.float().pow(2).sum().backward()
    got = (out.detach(), x.grad, weights.A.grad, weights.B.grad)
    x.grad, weights.A.grad, weights.B.grad = None, None, None
    ref_delta = (x[1:4].to(weights.A.dtype) @ weights.A.T @ weights.B.T) * 0.5
    ref = torch.cat([base(x[:1]), base(x[1:4]) + ref_delta.to(dtype), base(x[4:])])
    ref.float().pow(2).sum().backward()
    tol = {"atol": 1e-10, "rtol": 1e-10} if dtype == torch.float64 else {"atol": 0.1, "rtol": 0.02}
    for mine, theirs in zip(
        got, (ref.detach(), x.grad, weights.A.grad, weights.B.grad), strict=True
    ):
        torch.testing.assert_close(mine, theirs, **tol)
    assert torch.equal(got[0][0], base(x).detach()[0])  # a row outside every segment: untouched
