"""MultiLoraTransformersModel with what upstream Twinkle's client sends: rolled labels and extra
dataset columns, per-call advantages / old_logps / ref_outputs, Adam, DPOLoss / GRPOLoss
arguments, add_metric('DPOMetric'); and upstream's Tinker DPO convention at the backend."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from engine.errors import UserInputError
from engine.protocol import DatumInput, ForwardBackwardInput
from tests.unit.model_api_helpers import LORA, TEXTS, new_model, to_datums

LN2 = math.log(2.0)


@pytest.fixture(scope="module")
def seqs(tiny_model_dir: Path) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    return [tok(t)["input_ids"] for t in TEXTS]


@pytest.fixture(scope="module")
def model(tiny_model_dir: Path):
    return new_model(tiny_model_dir)


_names = iter(range(10**6))


def adapter(m, **kw) -> str:
    name = f"a{next(_names)}"
    m.add_adapter_to_model(name, LORA, **kw)
    return name


def upstream_row(seq: list[int], prompt_len: int) -> dict:
    """A row as upstream's template encodes it: labels rolled left by one (labels[i] is the target
    of input_ids[i], last -100), plus the dataset columns upstream keeps."""
    hf_labels = [-100] * prompt_len + seq[prompt_len:]
    return {
        "input_ids": list(seq),
        "labels": hf_labels[1:] + [-100],
        "attention_mask": [1] * len(seq),
        "position_ids": list(range(len(seq))),
        "length": len(seq),
        "messages": [{"role": "user", "content": "hi", "tool_calls": None}],
        "query": "q",
        "response": "r",
        "tag": None,
        "user_data": [{"k": "v"}],
        "question": "2+3?",
        "answer": "5",
    }


def tinker_of(row: dict) -> dict:
    """Upstream's own Tinker conversion of a rolled row."""
    labels = np.asarray(row["labels"])
    return {
        "model_input": row["input_ids"],
        "target_tokens": np.where(labels == -100, 0, labels),
        "weights": (labels != -100).astype(np.float32),
    }


# ----------------------------------------------------------------------------------- labels
def test_rolled_conversion_and_label_format_errors() -> None:
    (d,) = to_datums([{"input_ids": [5, 6, 7, 8], "labels": [-100, 7, 8, -100], "tag": "x"}])
    assert d.tokens == [5, 6, 7, 8]
    assert d.loss_fn_inputs["target_tokens"].tolist() == [0, 7, 8, 0]
    assert d.loss_fn_inputs["weights"].tolist() == [0.0, 1.0, 1.0, 0.0]
    assert set(d.loss_fn_inputs) == {"target_tokens", "weights"}  # "tag" ignored
    # padding dropped; no labels = input_ids rolled; per-token arrays aligned without a shift
    (p,) = to_datums(
        [{"input_ids": [1, 2, 3, 0], "attention_mask": [1, 1, 1, 0], "logprobs": [0, -1, -2, 9]}]
    )
    assert p.tokens == [1, 2, 3] and p.loss_fn_inputs["target_tokens"].tolist() == [2, 3, 0]
    assert p.loss_fn_inputs["weights"].tolist() == [1.0, 1.0, 0.0]
    assert p.loss_fn_inputs["logprobs"].tolist() == [0, -1, -2]
    with pytest.raises(UserInputError, match="label_format.*'shifted'.*rolled, hf"):
        to_datums([{"input_ids": [1, 2]}], label_format="shifted")


def test_upstream_row_trains_the_same_as_upstreams_tinker_conversion(model, seqs) -> None:
    name = adapter(model)
    rows = [upstream_row(s, 3) for s in seqs[:2]]
    ours = model.forward_only(rows, adapter_name=name)
    ref = model.forward_only([tinker_of(r) for r in rows], adapter_name=name)
    assert ours["loss_sum"] == pytest.approx(ref["loss_sum"], abs=1e-5)
    assert ours["num_tokens"] == sum(len(s) - 3 for s in seqs[:2])
    # the same labels un-rolled, given as HF, train the same targets
    hf_rows = [{"input_ids": s, "labels": [-100] * 3 + s[3:]} for s in seqs[:2]]
    hf = model.forward_only(hf_rows, adapter_name=name, label_format="hf")
    assert hf["loss_sum"] == pytest.approx(ours["loss_sum"], abs=1e-5)
    # ... while reading the rolled row as HF trains other targets (the bug this guards against)
    wrong = model.forward_only(rows, adapter_name=name, label_format="hf")
    assert abs(wrong["loss_sum"] - ours["loss_sum"]) > 1e-2
    # per-sample logps sit at input positions (len(input_ids)), equal to the Tinker logprobs
    for r, lp, tl in zip(rows, ours["logps"], ref["logprobs"], strict=True):
        assert len(lp) == len(r["input_ids"])
        np.testing.assert_allclose(lp, tl, atol=1e-6)
    # hf: position 0 has no target; logps[i] is log p(input_ids[i])
    assert hf["logps"][0][0] == 0.0 and hf["logps"][0][1:] == pytest.approx(hf["logprobs"][0])
    json.dumps(ours)  # JSON-able as is


# ----------------------------------------------------------------------------------- per call
def test_grpo_with_per_call_advantages_and_completion_only_old_logps(model, seqs) -> None:
    name = adapter(model)
    rows = [upstream_row(s, 4) for s in seqs[:2]]
    n_trained = [len(s) - 4 for s in seqs[:2]]
    lp = model.forward_only(rows, adapter_name=name)["logps"]  # the "sampler's" log-probs
    model.set_loss("GRPOLoss", epsilon=0.2, beta=0.0, adapter_name=name)
    # upstream's cookbook: old_logps are the completion's sampler log-probs only
    old = [
        [lp[i][j] for j, lab in enumerate(r["labels"]) if lab != -100] for i, r in enumerate(rows)
    ]
    assert [len(o) for o in old] == n_trained
    out = model.forward_backward(rows, adapter_name=name, advantages=[1.0, -0.5], old_logps=old)
    # ratio 1 at every trained position: loss = -sum(A) over the trained positions
    assert out["loss_sum"] == pytest.approx(-(1.0 * n_trained[0] - 0.5 * n_trained[1]), abs=1e-4)
    # full-length old_logps (one per input position) give the same
    full = model.forward_backward(rows, adapter_name=name, advantages=[1.0, -0.5], old_logps=lp)
    assert full["loss_sum"] == out["loss_sum"]
    assert model.step(adapter_name=name)["grad_norm"] > 0
    bad = [old[0], old[1][:5]]
    want = rf"old_logps\[1\]: length 5, expected {n_trained[1]} \(trained positions\) or "
    with pytest.raises(UserInputError, match=want + rf"{len(seqs[1])} \(input_ids\)"):
        model.forward_backward(rows, adapter_name=name, advantages=[1.0, -0.5], old_logps=bad)
    with pytest.raises(UserInputError, match=r"advantages: 1 entries, expected 2"):
        model.forward_backward(rows, adapter_name=name, advantages=[1.0], old_logps=old)


def test_dpo_with_ref_outputs_round_trip_metric_and_reference_free(model, seqs) -> None:
    name = adapter(model)
    model.set_loss(
        "DPOLoss",
        beta=0.1,
        loss_type="sigmoid",
        reference_free=False,
        sft_weight=0,
        adapter_name=name,
    )
    model.add_metric("DPOMetric", adapter_name=name, is_training=None, beta=0.1)
    pairs = [upstream_row(s, 3) for s in (seqs[0], seqs[1], seqs[3], seqs[2])]
    ref = model.forward_only(pairs, adapter_name=name, disable_lora=True)
    json.dumps(ref)
    out = model.forward_backward(pairs, adapter_name=name, ref_outputs=ref)
    # a fresh LoRA (B = 0) is the base model: policy = reference, every pair at log(2);
    # DPOLoss is upstream's mean over the pairs (loss_sum = loss for DPOLoss)
    assert out["loss"] == out["loss_sum"] == pytest.approx(LN2, abs=1e-5)
    metric = model.calculate_metric(is_training=True, adapter_name=name)
    seq = [
        sum(lp * (lab != -100) for lp, lab in zip(row_lp, r["labels"], strict=True))
        for row_lp, r in zip(ref["logps"], pairs, strict=True)
    ]
    assert metric["logps/chosen"] == pytest.approx((seq[0] + seq[2]) / 2, abs=1e-4)
    assert metric["logps/rejected"] == pytest.approx((seq[1] + seq[3]) / 2, abs=1e-4)
    assert metric["rewards/margins"] == pytest.approx(0.0, abs=1e-5)
    assert metric["rewards/chosen"] == pytest.approx(0.0, abs=1e-5)
    assert metric["rewards/accuracies"] == 0.0
    assert "logps/chosen" not in model.calculate_metric(is_training=True, adapter_name=name)
    # reference_free: the reference log-probs are 0
    model.set_loss("DPOLoss", beta=0.1, reference_free=True, adapter_name=name)
    free = model.forward_only(pairs, adapter_name=name)
    want = (
        sum(-math.log(1 / (1 + math.exp(-0.1 * (seq[2 * p] - seq[2 * p + 1])))) for p in range(2))
        / 2
    )  # mean over the 2 pairs
    assert free["loss"] == pytest.approx(want, abs=1e-4)
    with pytest.raises(UserInputError, match="ref_outputs.*logps"):
        model.forward_backward(pairs, adapter_name=name, ref_outputs={"loss": 1.0})
    with pytest.raises(UserInputError, match="DPOMetric.*even"):
        model.forward_backward(pairs[:3], adapter_name=name)


# ----------------------------------------------------------------------------------- names
def test_optimizer_loss_metric_and_task_names(model) -> None:
    name = adapter(model)
    model.set_optimizer("Adam", lr=1e-3, adapter_name=name)
    opt = model.get_train_configs(adapter_name=name)["optimizer"]
    assert opt == {
        "name": "Adam",
        "lr": 1e-3,
        "betas": (0.9, 0.999),
        "eps": 1e-8,
        "weight_decay": 0.0,
    }
    with pytest.raises(UserInputError, match="weight_decay.*AdamW"):
        model.set_optimizer("Adam", lr=1e-3, weight_decay=0.01, adapter_name=name)
    with pytest.raises(UserInputError, match="'SGD'.*AdamW, Adam"):
        model.set_optimizer("SGD", adapter_name=name)
    model.set_optimizer("AdamW", adapter_name=name)
    opt = model.get_train_configs(adapter_name=name)["optimizer"]
    assert opt["name"] == "AdamW" and opt["betas"] == (0.9, 0.95) and opt["eps"] == 1e-12
    with pytest.raises(UserInputError, match="loss_type 'hinge'.*accepted: sigmoid"):
        model.set_loss("DPOLoss", beta=0.1, loss_type="hinge", adapter_name=name)
    with pytest.raises(UserInputError, match="InfonceLoss: hard_negatives 4 is not supported"):
        model.set_loss("InfonceLoss", temperature=0.1, hard_negatives=4, adapter_name=name)
    with pytest.raises(UserInputError, match="unknown loss 'FocalLoss'.*CrossEntropyLoss.*DPOLoss"):
        model.set_loss("FocalLoss", adapter_name=name)
    with pytest.raises(UserInputError, match="GRPOLoss: beta"):
        model.set_loss("GRPOLoss", epsilon=0.2, beta=0.04, adapter_name=name)
    model.set_loss("CrossEntropyLoss", adapter_name=name)
    with pytest.raises(UserInputError, match="task: 'embedding' needs an embedding loss"):
        model.forward_backward([{"input_ids": [1, 2, 3]}], adapter_name=name, task="embedding")
    with pytest.raises(UserInputError, match="unknown metric_cls 'Bleu'.*DPOMetric"):
        model.add_metric("Bleu", adapter_name=name)
    with pytest.raises(UserInputError, match="EmbeddingMetric: unsupported argument"):
        model.add_metric("EmbeddingMetric", beta=1.0, adapter_name=name)
    model.add_metric("LossMetric", adapter_name=name)  # built in: adds nothing
    assert "loss" in model.calculate_metric(adapter_name=name)


# ----------------------------------------------------------------------------------- tinker dpo
def test_tinker_dpo_convention_runs_as_dpo_at_the_backend(model, seqs) -> None:
    name = adapter(model)
    be = model.backend
    rows = [tinker_of(upstream_row(s, 3)) for s in (seqs[0], seqs[1])]
    plain = [
        DatumInput(r["model_input"], {"target_tokens": r["target_tokens"], "weights": r["weights"]})
        for r in rows
    ]
    ref = be.forward_backward(
        name,
        ForwardBackwardInput(plain, "cross_entropy", {"disable_lora": True}, forward_only=True),
    )
    ref_lp = [o["logprobs"] for o in ref.outputs]
    tinker = [
        DatumInput(d.tokens, {**d.loss_fn_inputs, "ref_logps": lp})
        for d, lp in zip(plain, ref_lp, strict=True)
    ]
    native = [
        DatumInput(d.tokens, {**d.loss_fn_inputs, "ref_logprobs": lp})
        for d, lp in zip(plain, ref_lp, strict=True)
    ]
    cfg = {"dpo_beta": 0.2, "dpo_sft_weight": 1.0}
    a = be.forward_backward(
        name, ForwardBackwardInput(tinker, "importance_sampling", cfg, forward_only=True)
    )
    b = be.forward_backward(
        name,
        ForwardBackwardInput(
            native,
            "dpo",
            {"beta": 0.2, "sft_weight": 1.0, "mean_reduction": 1.0},
            forward_only=True,
        ),
    )
    assert a.metrics == b.metrics and "dpo_accuracy:mean" in a.metrics
    # upstream's DPOLoss reduction: mean over the pair + sft_weight x the chosen token mean
    chosen_w = np.asarray(plain[0].loss_fn_inputs["weights"])
    chosen_nll = -float((np.asarray(ref_lp[0]) * chosen_w).sum()) / float(chosen_w.sum())
    assert a.metrics["loss:sum"] == pytest.approx(LN2 + chosen_nll, abs=1e-4)
    with pytest.raises(UserInputError, match="dpo_beta.*ref_logps.*data\\[0\\]"):
        be.forward_backward(name, ForwardBackwardInput(plain, "importance_sampling", cfg))
    with pytest.raises(UserInputError, match="dpo_loss_type.*'ipo'.*sigmoid"):
        be.forward_backward(
            name, ForwardBackwardInput(tinker, "importance_sampling", {"dpo_loss_type": "ipo"})
        )
    with pytest.raises(UserInputError, match="dpo_gamma.*dpo_beta"):
        be.forward_backward(
            name, ForwardBackwardInput(tinker, "importance_sampling", {"dpo_gamma": 1})
        )
    # without dpo_* keys importance_sampling stays Tinker's (needs logprobs/advantages)
    with pytest.raises(UserInputError, match="logprobs: required by loss_fn 'importance_sampling'"):
        be.forward_backward(name, ForwardBackwardInput(tinker, "importance_sampling", {}))


def test_trainer_slicing_keeps_tinker_dpo_pairs_together() -> None:
    from engine.scheduling.slicing import slice_input

    data = [DatumInput([1] * 5, {}) for _ in range(4)]
    for loss_fn, cfg, sizes in (
        ("importance_sampling", {"dpo_beta": 0.1}, [2, 2]),
        ("dpo", {}, [2, 2]),
        ("importance_sampling", {}, [1, 1, 1, 1]),
    ):
        parts = slice_input(ForwardBackwardInput(data, loss_fn, cfg), slice_tokens=6)
        assert [len(p.data) for p, _ in parts] == sizes, loss_fn


def test_per_call_inputs_with_hf_rows_and_two_phase_forward_backward(model, seqs) -> None:
    name = adapter(model)
    rows = [{"input_ids": s, "labels": [-100] * 3 + s[3:]} for s in seqs[2:4]]
    lp = model.forward_only(rows, adapter_name=name, label_format="hf")["logps"]
    assert [len(x) for x in lp] == [len(s) for s in seqs[2:4]]  # input positions
    model.set_loss("ppo", adapter_name=name)
    # logps of an hf pass are valid full-length old_logps of the same hf rows: ratio 1
    fwd = model.forward(
        rows, adapter_name=name, label_format="hf", advantages=[[2.0], -1.0], old_logps=lp
    )
    n = [len(s) - 3 for s in seqs[2:4]]
    assert fwd["loss_sum"] == pytest.approx(-(2.0 * n[0] - 1.0 * n[1]), abs=1e-4)
    back = model.backward(adapter_name=name)  # the cached batch keeps the per-call inputs
    assert back["loss_sum"] == pytest.approx(fwd["loss_sum"], abs=1e-5)
    assert model.step(adapter_name=name)["grad_norm"] > 0
