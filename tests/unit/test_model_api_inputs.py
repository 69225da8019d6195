"""MultiLoraTransformersModel: HF and Tinker inputs, errors naming the bad input, LoRA configs,
and the losses besides cross-entropy (policy-gradient, DPO)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from engine.errors import AdapterNotFoundError, UserInputError
from engine.local.model import MultiLoraTransformersModel
from engine.protocol import DatumInput
from tests.unit.model_api_helpers import (
    LORA,
    TEXTS,
    hf,
    new_model,
    to_datums,
)


@pytest.fixture(scope="module")
def seqs(tiny_model_dir: Path) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    return [tok(t)["input_ids"] for t in TEXTS]


# ------------------------------------------------------------------------------- inputs & errors
def test_hf_labels_minus_100_give_zero_weights() -> None:
    (d,) = to_datums(
        [{"input_ids": [5, 6, 7, 8, 9], "labels": [-100, -100, 7, -100, 9]}], label_format="hf"
    )
    assert d.tokens == [5, 6, 7, 8]
    assert d.loss_fn_inputs["target_tokens"].tolist() == [6, 7, 8, 9]  # ignored → next input id
    assert d.loss_fn_inputs["weights"].tolist() == [0.0, 1.0, 0.0, 1.0]
    # padding (attention_mask 0) is dropped; a batched dict is split per row; scalar advantages
    # are broadcast over the trained positions; per-token arrays are shifted like the labels
    rows = to_datums(
        {
            "input_ids": [[1, 2, 3, 0], [4, 5, 6, 7]],
            "labels": [[-100, 2, 3, -100], [4, 5, 6, 7]],
            "attention_mask": [[1, 1, 1, 0], [1, 1, 1, 1]],
            "advantages": [2.0, -1.0],
            "logprobs": [[0, -1, -2, 0], [0, -3, -4, -5]],
        },
        label_format="hf",
    )
    assert [r.tokens for r in rows] == [[1, 2], [4, 5, 6]]
    assert rows[0].loss_fn_inputs["weights"].tolist() == [1.0, 1.0]
    assert rows[0].loss_fn_inputs["advantages"].tolist() == [2.0, 2.0]
    assert rows[1].loss_fn_inputs["logprobs"].tolist() == [-3, -4, -5]
    tinker = to_datums({"model_input": [1, 2], "target_tokens": [2, 3]})[0]
    assert tinker.loss_fn_inputs["weights"].tolist() == [1.0, 1.0]
    with pytest.raises(UserInputError, match="set_template"):
        to_datums([{"messages": [{"role": "user", "content": "hi"}]}])


def test_hf_and_tinker_inputs_give_the_same_loss(tiny_model_dir: Path, seqs) -> None:
    m = new_model(tiny_model_dir)
    m.add_adapter_to_model("default", LORA)
    s = seqs[0]
    w = np.array([0.0] * 2 + [1.0] * (len(s) - 3), np.float32)
    tinker = {"model_input": s[:-1], "target_tokens": s[1:], "weights": w}
    datum = DatumInput(
        tokens=s[:-1], loss_fn_inputs={"target_tokens": np.array(s[1:]), "weights": w}
    )
    a, b, c = (
        m.forward_only([x], label_format="hf")["loss_sum"] for x in (hf(s, 3), tinker, datum)
    )
    assert a == b == c
    out = m.forward_only([hf(s, 3)], label_format="hf")
    assert out["num_tokens"] == len(s) - 3 and out["loss"] == pytest.approx(a / (len(s) - 3))
    assert len(out["logprobs"][0]) == len(s) - 1


def test_bad_names_raise_user_input_error_naming_them(tiny_model_dir: Path) -> None:
    m = new_model(tiny_model_dir)
    with pytest.raises(UserInputError, match="embed_tokens"):
        m.add_adapter_to_model("default", {"r": 4, "target_modules": ["q_proj", "embed_tokens"]})
    with pytest.raises(AdapterNotFoundError, match="default"):
        m.set_loss("cross_entropy")
    m.add_adapter_to_model("default", {"r": 4})
    with pytest.raises(UserInputError, match="FocalLoss.*cross_entropy"):
        m.set_loss("FocalLoss")

    class KLDivLoss:
        pass

    with pytest.raises(UserInputError, match="KLDivLoss"):
        m.set_loss(KLDivLoss)
    with pytest.raises(UserInputError, match="SGD"):
        m.set_optimizer("SGD", lr=0.1)
    with pytest.raises(UserInputError, match="SGD"):
        m.set_optimizer(torch.optim.SGD)
    with pytest.raises(UserInputError, match="amsgrad"):
        m.set_optimizer("AdamW", amsgrad=True)
    with pytest.raises(UserInputError, match="lr"):
        m.set_optimizer("AdamW", lr=-1.0)
    with pytest.raises(UserInputError, match="'step'"):
        m.set_lr_scheduler("step", step_size=3)
    with pytest.raises(UserInputError, match="total_steps"):
        m.set_lr_scheduler("linear", warmup_steps=3)
    with pytest.raises(UserInputError, match="use_dora"):
        m.add_adapter_to_model("dora", {"r": 4, "use_dora": True})
    with pytest.raises(UserInputError, match="exists"):
        m.add_adapter_to_model("default", {"r": 4})
    with pytest.raises(UserInputError, match="model_id"):
        MultiLoraTransformersModel("no/such-model", data_dir=tiny_model_dir.parent)


def test_lora_configs_and_loss_mapping(tiny_model_dir: Path) -> None:
    from peft import LoraConfig

    m = new_model(tiny_model_dir, max_lora_rank=8)
    m.add_adapter_to_model(
        "peft",
        LoraConfig(
            r=8, lora_alpha=16, target_modules=["gate_proj", "up_proj", "down_proj", "lm_head"]
        ),
    )
    spec = m.backend.adapter_spec("peft")
    assert (spec.rank, spec.alpha, spec.train_attn, spec.train_mlp, spec.train_unembed) == (
        8,
        16.0,
        False,
        True,
        True,
    )
    with pytest.warns(UserWarning, match="k_proj"):
        m.add_adapter_to_model("qv", LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    with pytest.raises(UserInputError, match="max LoRA rank"):
        m.add_adapter_to_model("big", {"r": 16})
    m.set_loss("GRPOLoss", epsilon=0.2, adapter_name="peft")
    loss = m.get_train_configs(adapter_name="peft")["loss"]
    assert loss["loss_fn"] == "ppo"
    assert loss["config"] == pytest.approx(
        {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2, "upstream_mean": 1.0}
    )  # upstream_mean: upstream's reduction (tests/unit/test_upstream_reductions.py)
    m.set_loss(torch.nn.CrossEntropyLoss(), adapter_name="peft")
    assert m.get_train_configs(adapter_name="peft")["loss"]["loss_fn"] == "cross_entropy"
    m.set_loss("DPOLoss", beta=0.2, adapter_name="peft")
    assert m.get_train_configs(adapter_name="peft")["loss"]["config"] == {
        "beta": 0.2,
        "upstream_mean": 1.0,
    }
    with pytest.raises(UserInputError, match="beta"):
        m.set_loss("GRPOLoss", beta=0.04, adapter_name="peft")


@pytest.mark.parametrize(
    "loss,kw",
    [
        ("importance_sampling", {}),
        ("ppo", {}),
        ("GRPOLoss", {"epsilon": 0.2}),
        ("cispo", {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}),
        ("dro", {"beta": 0.05}),
    ],
)
def test_policy_gradient_losses(tiny_model_dir: Path, seqs, loss, kw) -> None:
    m = new_model(tiny_model_dir)
    m.add_adapter_to_model("default", LORA)
    plain = [hf(s, 3) for s in seqs[:2]]
    sampled = m.forward_only(plain, label_format="hf")["logprobs"]
    batch = [
        dict(d, logprobs=np.concatenate([[0.0], lp]), advantages=adv)  # HF-aligned logprobs
        for d, lp, adv in zip(plain, sampled, (1.0, -0.5), strict=True)
    ]
    m.set_loss(loss, **kw)
    out = m.forward_backward(batch, label_format="hf")
    if loss == "GRPOLoss":  # upstream's reduction: ratio 1, mean over sequences of mean(-A)
        assert out["loss"] == pytest.approx(-(1.0 - 0.5) / 2, abs=1e-5)
    else:
        assert math.isfinite(out["loss"]) and out["loss"] == out["loss_sum"]
    assert m.step()["grad_norm"] > 0


def test_dpo_loss(tiny_model_dir: Path, seqs) -> None:
    m = new_model(tiny_model_dir)
    m.add_adapter_to_model("default", LORA)
    pairs = [
        hf(seqs[0], 3),
        hf(seqs[1], 3),
        hf(seqs[3], 3),
        hf(seqs[2], 3),
    ]  # chosen, rejected, ...
    ref = m.forward_only(pairs, label_format="hf")["logprobs"]
    batch = [dict(d, ref_logprobs=lp) for d, lp in zip(pairs, ref, strict=True)]  # [N]: not shifted
    m.set_loss("DPOLoss", beta=0.1)
    out = m.forward_backward(batch, label_format="hf")
    assert math.isfinite(out["loss"])
    assert m.step()["grad_norm"] > 0
