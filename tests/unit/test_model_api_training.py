"""MultiLoraTransformersModel, the in-process upstream-Twinkle style training API: training,
several adapters, gradient accumulation, schedules, checkpoints."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from engine.errors import UserInputError
from engine.local.model import TRAIN_CONFIG_FILE
from tests.unit.model_api_helpers import (
    LORA,
    TEXTS,
    assert_params_close,
    hf,
    new_model,
    params,
)


@pytest.fixture(scope="module")
def seqs(tiny_model_dir: Path) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    return [tok(t)["input_ids"] for t in TEXTS]


# ----------------------------------------------------------------------------------- training
def test_sft_cross_entropy_halves_loss_in_20_steps(tiny_model_dir: Path, seqs) -> None:
    m = new_model(tiny_model_dir)
    m.add_adapter_to_model("default", {"r": 8, "lora_alpha": 16, "target_modules": "all"})
    m.set_loss("CrossEntropyLoss")
    m.set_optimizer("AdamW", lr=1e-2)
    batch = [hf(s, prompt_len=3) for s in seqs]
    first = None
    for _ in range(20):
        out = m.forward_backward(batch, label_format="hf")
        first = out["loss"] if first is None else first
        assert out["num_tokens"] == sum(len(s) - 1 - 2 for s in seqs)  # 3 ignored → 2 fewer targets
        assert out["loss"] == pytest.approx(out["loss_sum"] / out["num_tokens"])
        assert m.clip_grad_and_step(max_grad_norm=1.0) > 0
    final = m.forward_only(batch, label_format="hf")["loss"]
    assert final <= 0.5 * first, (first, final)
    metrics = m.calculate_metric(is_training=True)
    assert metrics["step"] == 20 and metrics["num_batches"] == 20 and metrics["lr"] == 1e-2
    assert metrics["grad_norm"] > 0 and metrics["num_sequences"] == 80
    assert m.calculate_metric()["num_batches"] == 0  # reset by the previous call
    assert m.calculate_metric(is_training=False)["loss"] == pytest.approx(final)


def test_two_adapters_train_independently(tiny_model_dir: Path, seqs) -> None:
    configs = {
        "a": dict(LORA, seed=1),
        "b": {
            "r": 8,
            "alpha": 16,
            "seed": 2,
            "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"],
        },
    }
    data = {"a": [hf(s) for s in seqs[:2]], "b": [hf(s, 2) for s in seqs[2:]]}
    lrs = {"a": 5e-3, "b": 1e-2}

    def setup(m, name):
        m.add_adapter_to_model(name, configs[name])
        m.set_optimizer("AdamW", lr=lrs[name], weight_decay=0.1, adapter_name=name)

    def alone(name):
        m = new_model(tiny_model_dir)
        setup(m, name)
        losses = []
        for _ in range(4):
            losses.append(
                m.forward_backward(data[name], adapter_name=name, label_format="hf")["loss_sum"]
            )
            m.clip_grad_and_step(adapter_name=name)
        return losses, params(m, name)

    expected = {name: alone(name) for name in configs}
    m = new_model(tiny_model_dir)
    for name in configs:
        setup(m, name)
    mixed = {"a": [], "b": []}
    for _ in range(4):
        mixed["a"].append(
            m.forward_backward(data["a"], adapter_name="a", label_format="hf")["loss_sum"]
        )
        mixed["b"].append(
            m.forward_backward(data["b"], adapter_name="b", label_format="hf")["loss_sum"]
        )
        m.clip_grad_and_step(adapter_name="a")  # steps a while b holds a pending gradient
        m.clip_grad_and_step(adapter_name="b")
    for name in configs:
        np.testing.assert_allclose(mixed[name], expected[name][0], rtol=0, atol=1e-6)
        assert_params_close(params(m, name), expected[name][1])
    assert m.get_train_configs(adapter_name="b")["lora"]["target_modules"] == [
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
    ]


def test_gradient_accumulation_of_half_batches_equals_full_batch(
    tiny_model_dir: Path, seqs
) -> None:
    m = new_model(tiny_model_dir)
    m.add_adapter_to_model("acc", LORA, gradient_accumulation_steps=2)
    m.add_adapter_to_model("full", LORA)
    for name in ("acc", "full"):
        m.set_optimizer(lr=1e-3, adapter_name=name)
        m.set_lr_scheduler("linear", warmup_steps=0, total_steps=10, adapter_name=name)
    batch = [hf(s, 2) for s in seqs]
    for _ in range(2):  # two optimizer steps, so the second runs on non-zero B as well
        before = params(m, "acc")
        m.forward_backward(batch[:2], adapter_name="acc", label_format="hf")
        # upstream loop: clip_grad_and_step after every micro-batch; inside the window it only
        # counts (no step, zero_grad and lr_step are no-ops), so the gradient survives
        m.clip_grad_and_step(max_grad_norm=0.5, adapter_name="acc")
        assert_params_close(params(m, "acc"), before, atol=0)
        assert m.get_train_configs(adapter_name="acc")["lr_scheduler_position"] == _ + 0
        m.forward_backward(batch[2:], adapter_name="acc", label_format="hf")
        m.clip_grad_and_step(max_grad_norm=0.5, adapter_name="acc")
        m.forward_backward(batch, adapter_name="full", label_format="hf")
        m.clip_grad_and_step(max_grad_norm=0.5, adapter_name="full")
        assert_params_close(params(m, "acc"), params(m, "full"))
    for name in ("acc", "full"):
        cfg = m.get_train_configs(adapter_name=name)
        assert cfg["optimizer_steps"] == 2 and cfg["lr_scheduler_position"] == 2
    # plain step(): only every second call applies the optimizer
    m.forward_backward(batch[:2], adapter_name="acc", label_format="hf")
    assert m.step(adapter_name="acc") is None
    m.forward_backward(batch[2:], adapter_name="acc", label_format="hf")
    assert m.step(adapter_name="acc")["step"] == 3


def test_zero_grad_drops_the_accumulated_gradient(tiny_model_dir: Path, seqs) -> None:
    m = new_model(tiny_model_dir)
    m.add_adapter_to_model("x", LORA)
    m.add_adapter_to_model("y", LORA)
    m.forward_backward([hf(seqs[0])], adapter_name="x", label_format="hf")  # dropped below
    m.zero_grad(adapter_name="x")
    assert m.clip_grad_norm(adapter_name="x") == 0.0
    with pytest.raises(UserInputError, match="no gradient"):
        m.step(adapter_name="x")
    for name in ("x", "y"):
        m.forward_backward([hf(seqs[1])], adapter_name=name, label_format="hf")
        m.step(adapter_name=name)
    assert_params_close(params(m, "x"), params(m, "y"))


def test_two_phase_forward_calculate_loss_backward(tiny_model_dir: Path, seqs) -> None:
    m = new_model(tiny_model_dir)
    m.add_adapter_to_model("p", LORA)
    m.add_adapter_to_model("q", LORA)
    batch = [hf(s, 1) for s in seqs[:2]]
    fwd = m.forward(batch, adapter_name="p", label_format="hf")
    loss = m.calculate_loss(adapter_name="p")
    m.backward(adapter_name="p")
    with pytest.raises(UserInputError, match="call forward first"):
        m.backward(adapter_name="p")
    ref = m.forward_backward(batch, adapter_name="q", label_format="hf")
    assert loss == fwd["loss"] == pytest.approx(ref["loss"], abs=1e-6)
    m.step(adapter_name="p")
    m.step(adapter_name="q")
    assert_params_close(params(m, "p"), params(m, "q"))


# ----------------------------------------------------------------------------------- schedules
def test_linear_scheduler_sets_the_lr_of_each_step(tiny_model_dir: Path, seqs) -> None:
    m = new_model(tiny_model_dir)
    m.add_adapter_to_model("default", LORA)
    m.set_optimizer("AdamW", lr=1e-2, betas=(0.9, 0.999), eps=1e-8)
    m.set_lr_scheduler("linear", warmup_steps=2, num_training_steps=6)
    expected = [0.0, 0.005, 0.01, 0.0075, 0.005, 0.0025, 0.0, 0.0]
    seen = []
    for i, lr in enumerate(expected):
        assert m.get_train_configs()["current_lr"] == pytest.approx(lr, abs=1e-15)
        before = params(m)
        m.forward_backward([hf(seqs[0])], label_format="hf")
        out = m.step()
        seen.append(out["learning_rate"])
        if lr == 0.0:  # weight decay 0 and lr 0: AdamW leaves the weights alone
            assert_params_close(params(m), before, atol=0)
        elif i == 1:
            key = next(k for k in before if k.endswith("lora_B.weight"))
            assert not torch.equal(params(m)[key], before[key])
        m.lr_step()
    assert seen == pytest.approx(expected, abs=1e-15)
    m.set_lr_scheduler("cosine", warmup_steps=0, total_steps=4, min_lr_ratio=0.1)
    lrs = []
    for _ in range(6):
        lrs.append(m.get_train_configs()["current_lr"])
        m.lr_step()
    cos = [0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(t, 4) / 4)) for t in range(6)]
    assert lrs == pytest.approx([1e-2 * c for c in cos])
    m.set_lr_scheduler(lambda t: 0.5**t)
    m.lr_step()
    m.lr_step()
    assert m.get_train_configs()["current_lr"] == pytest.approx(1e-2 / 4)


# ----------------------------------------------------------------------------------- checkpoints
def test_save_load_with_optimizer_continues_exact_trajectory(
    tiny_model_dir, seqs, tmp_path
) -> None:
    batch = [hf(s, 2) for s in seqs]

    def train(m, n, name="default"):
        out = []
        for _ in range(n):
            out.append(m.forward_backward(batch, adapter_name=name, label_format="hf")["loss"])
            m.clip_grad_and_step(max_grad_norm=1.0, adapter_name=name)
        return out

    m = new_model(tiny_model_dir, data_dir=tmp_path / "data")
    m.add_adapter_to_model("default", LORA, gradient_accumulation_steps=1)
    m.set_optimizer("AdamW", lr=5e-3, weight_decay=0.01)
    m.set_lr_scheduler("cosine", warmup_steps=1, total_steps=8, min_lr_ratio=0.1)
    m.set_loss("cross_entropy")
    train(m, 3)
    path = Path(m.save("step3", save_optimizer=True))
    assert path == tmp_path / "data" / "local_checkpoints" / "default" / "step3"
    assert (path / "adapter_model.safetensors").is_file() and (
        path / "adapter_config.json"
    ).is_file()
    assert json.loads((path / TRAIN_CONFIG_FILE).read_text())["lr_scheduler_position"] == 3
    expected = train(m, 3)

    other = new_model(tiny_model_dir)
    other.load(str(path), adapter_name="resumed", load_optimizer=True)  # creates the adapter
    assert other.get_train_configs(adapter_name="resumed")["optimizer"]["lr"] == 5e-3
    np.testing.assert_allclose(train(other, 3, "resumed"), expected, rtol=0, atol=1e-6)
    assert_params_close(params(other, "resumed"), params(m))

    # weights only: same weights, fresh optimizer and schedule position
    other.load("step3", tmp_path / "data" / "local_checkpoints" / "default", adapter_name="resumed")
    cfg = other.get_train_configs(adapter_name="resumed")
    assert cfg["lr_scheduler_position"] == 0 and cfg["optimizer_steps"] == 0
    p = Path(m.save("out", output_dir=tmp_path / "explicit"))
    assert p == tmp_path / "explicit" / "out" and (p / "adapter_config.json").is_file()
