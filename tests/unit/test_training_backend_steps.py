"""TransformersTrainingBackend training: AdamW steps, gradient accumulation, interleaved adapters,
grad norm and clipping, checkpoints with optimizer state, adapter management."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from engine.backends.train_transformers import TransformersTrainingBackend
from engine.errors import AdapterNotFoundError, CheckpointError, UserInputError
from engine.protocol import AdamParams, LoraSpec
from tests.unit.training_backend_helpers import (
    TEXTS,
    backend,
    datum,
    fb,
    params_of,
)


@pytest.fixture(scope="module")
def seqs(tiny_model_dir: Path) -> list[np.ndarray]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    return [np.array(tok(t)["input_ids"], dtype=np.int64) for t in TEXTS]


def test_training_halves_loss(tiny_model_dir: Path, seqs) -> None:
    be = backend(tiny_model_dir)
    be.create_adapter("a", LoraSpec(rank=8))
    data = [datum(s) for s in seqs]
    ntok = sum(len(s) - 1 for s in seqs)
    losses = []
    for i in range(30):
        losses.append(fb(be, "a", data).metrics["loss:sum"] / ntok)
        m = be.optim_step("a", AdamParams(learning_rate=1e-2)).metrics
        assert m["step"] == i + 1 and m["learning_rate"] == 1e-2 and m["grad_norm"] > 0
    final = fb(be, "a", data, forward_only=True).metrics["loss:sum"] / ntok
    assert final <= 0.5 * losses[0], (losses[0], final)


def test_gradients_accumulate_and_forward_only_touches_nothing(tiny_model_dir: Path, seqs) -> None:
    one, two = backend(tiny_model_dir), backend(tiny_model_dir)
    for be in (one, two):
        be.create_adapter("a", LoraSpec(rank=4, seed=3))
    fb(one, "a", [datum(seqs[0])])
    fb(one, "a", [datum(s) for s in seqs[1:]], forward_only=True)  # must not add anything
    fb(one, "a", [datum(s) for s in seqs[1:]])
    fb(two, "a", [datum(s) for s in seqs])
    m1 = one.optim_step("a", AdamParams(learning_rate=1e-3)).metrics
    m2 = two.optim_step("a", AdamParams(learning_rate=1e-3)).metrics
    assert m1["grad_norm"] == pytest.approx(m2["grad_norm"], rel=1e-5)
    for k, v in params_of(one, "a").items():
        torch.testing.assert_close(v, params_of(two, "a")[k], atol=1e-6, rtol=0)
    fb(one, "a", [datum(seqs[0])], forward_only=True)
    with pytest.raises(UserInputError, match="no gradient accumulated"):
        one.optim_step("a", AdamParams())


def test_interleaved_adapters_equal_alone(tiny_model_dir: Path, seqs) -> None:
    specs = {
        "a": LoraSpec(rank=4, seed=1),
        "b": LoraSpec(rank=8, alpha=16.0, seed=2, train_mlp=False),
    }
    data = {"a": [datum(s) for s in seqs[:2]], "b": [datum(s) for s in seqs[2:]]}
    adam = AdamParams(learning_rate=5e-3, weight_decay=0.1)

    def run_alone(aid):
        be = backend(tiny_model_dir)
        be.create_adapter(aid, specs[aid])
        out = []
        for _ in range(4):
            out.append(fb(be, aid, data[aid]).metrics["loss:sum"])
            be.optim_step(aid, adam)
        return out

    alone = {aid: run_alone(aid) for aid in specs}
    be = backend(tiny_model_dir)
    for aid, spec in specs.items():
        be.create_adapter(aid, spec)
    mixed = {"a": [], "b": []}
    for _ in range(4):
        mixed["a"].append(fb(be, "a", data["a"]).metrics["loss:sum"])
        before_b = params_of(be, "b")
        mixed["b"].append(fb(be, "b", data["b"]).metrics["loss:sum"])
        be.optim_step("a", adam)  # steps a while b holds a pending gradient
        for k, v in params_of(be, "b").items():
            assert torch.equal(v, before_b[k])
        be.optim_step("b", adam)
    for aid in specs:
        np.testing.assert_allclose(mixed[aid], alone[aid], rtol=1e-6, atol=0)


def test_grad_norm_and_clipping(tiny_model_dir: Path, seqs) -> None:
    be = backend(tiny_model_dir)
    be.create_adapter("a", LoraSpec(rank=4))
    fb(be, "a", [datum(s) for s in seqs])
    st = be._adapters["a"]
    expected = math.sqrt(sum(float(p.grad.double().pow(2).sum()) for p in st.params.values()))
    seen = []
    real_step = st.optimizer.step

    def spy():
        seen.append(math.sqrt(sum(float(p.grad.double().pow(2).sum()) for p in st.params.values())))
        return real_step()

    st.optimizer.step = spy
    m = be.optim_step("a", AdamParams(learning_rate=1e-3, grad_clip_norm=0.5)).metrics
    assert m["grad_norm"] == pytest.approx(expected, rel=1e-9)  # reported before clipping
    assert expected > 0.5 and seen[0] == pytest.approx(0.5, rel=1e-4)
    assert all(p.grad is None for p in st.params.values())
    before = params_of(be, "a")
    fb(be, "a", [datum(seqs[0])])
    be.optim_step("a", AdamParams(learning_rate=0.0))
    assert all(torch.equal(v, params_of(be, "a")[k]) for k, v in before.items())


def test_save_load_with_optimizer_reproduces_next_step(
    tiny_model_dir: Path, seqs, tmp_path
) -> None:
    spec = LoraSpec(rank=4, alpha=8.0, seed=4)
    data = [datum(s) for s in seqs]
    adam = AdamParams(learning_rate=1e-2, beta2=0.99, weight_decay=0.01)
    be = backend(tiny_model_dir)
    be.create_adapter("a", spec)
    for _ in range(3):
        fb(be, "a", data)
        be.optim_step("a", adam)
    ckpt = tmp_path / "ckpt"
    size = be.save_state("a", str(ckpt), include_optimizer=True)
    files = {p.name for p in ckpt.iterdir()}
    assert files == {
        "adapter_model.safetensors",
        "adapter_config.json",
        "twinkle_state.json",
        "optimizer.pt",
        "manifest.json",
    }
    assert size == sum(p.stat().st_size for p in ckpt.iterdir())
    assert not [p for p in tmp_path.iterdir() if p.name != "ckpt"]  # no temp dir left
    fb(be, "a", data)
    m_orig = be.optim_step("a", adam).metrics
    loss_orig = fb(be, "a", data, forward_only=True).metrics["loss:sum"]

    other = backend(tiny_model_dir)
    assert other.load_state("restored", str(ckpt), include_optimizer=True) == spec
    fb(other, "restored", data)
    m_new = other.optim_step("restored", adam).metrics
    assert m_new["step"] == m_orig["step"] == 4
    for k, v in params_of(be, "a").items():
        torch.testing.assert_close(params_of(other, "restored")[k], v, atol=1e-6, rtol=0)
    loss_new = fb(other, "restored", data, forward_only=True).metrics["loss:sum"]
    assert loss_new == pytest.approx(loss_orig, rel=1e-6)

    # weights only: same weights, fresh optimizer and step count
    other.load_state("w", str(ckpt), include_optimizer=False)
    assert not other._adapters["w"].optimizer.state and other._adapters["w"].step == 0
    ref = TransformersTrainingBackend(str(tiny_model_dir))
    ref.load_state("a", str(ckpt), include_optimizer=True)
    for k, v in params_of(ref, "a").items():
        assert torch.equal(params_of(other, "w")[k], v)


def test_checkpoint_errors(tiny_model_dir: Path, seqs, tmp_path) -> None:
    be = backend(tiny_model_dir)
    be.create_adapter("a", LoraSpec(rank=4))
    ckpt = tmp_path / "c"
    be.save_state("a", str(ckpt), include_optimizer=False)
    with pytest.raises(CheckpointError, match="already exists"):
        be.save_state("a", str(ckpt), include_optimizer=False)
    with pytest.raises(CheckpointError, match="optimizer"):
        be.load_state("x", str(ckpt), include_optimizer=True)
    assert not be.has_adapter("x")
    be.create_adapter("r8", LoraSpec(rank=8))
    with pytest.raises(CheckpointError, match="does not match"):
        be.load_state("r8", str(ckpt), include_optimizer=False)
    with pytest.raises(CheckpointError, match="not found"):
        be.load_state("x", str(tmp_path / "nope"), include_optimizer=False)
    state = json.loads((ckpt / "twinkle_state.json").read_text())
    assert state["spec"]["rank"] == 4 and state["step"] == 0 and state["has_optimizer"] is False
    weights = ckpt / "adapter_model.safetensors"
    raw = bytearray(weights.read_bytes())
    raw[-1] ^= 0xFF
    weights.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match="sha256"):
        be.load_state("x", str(ckpt), include_optimizer=False)
    assert not be.has_adapter("x")


def test_adapter_management(tiny_model_dir: Path, seqs) -> None:
    be = backend(tiny_model_dir, max_lora_rank=64)
    assert be.vocab_size == 2048 and be.max_lora_rank == 64
    be.create_adapter("a", LoraSpec(rank=16, seed=1))
    assert be.has_adapter("a") and be.adapter_spec("a") == LoraSpec(rank=16, seed=1)
    with pytest.raises(UserInputError, match="exists already"):
        be.create_adapter("a", LoraSpec(rank=16))
    with pytest.raises(
        UserInputError,
        match="lora_config.rank 128 exceeds max LoRA rank 64 for model twinkle/tiny-chat",
    ):
        be.create_adapter("b", LoraSpec(rank=128))
    with pytest.raises(UserInputError, match="lora_config.rank 12 must be a power of 2"):
        be.create_adapter("b", LoraSpec(rank=12))
    with pytest.raises(UserInputError, match="lora_config"):
        be.create_adapter(
            "b", LoraSpec(rank=4, train_attn=False, train_mlp=False, train_unembed=False)
        )
    be.delete_adapter("a")
    be.delete_adapter("a")  # no-op
    assert not be.has_adapter("a")
    with pytest.raises(AdapterNotFoundError):
        fb(be, "a", [datum(seqs[0])])
    with pytest.raises(AdapterNotFoundError):
        be.adapter_spec("a")
