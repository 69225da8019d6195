"""Upstream Twinkle's loss reductions in `MultiLoraTransformersModel`: the value AND the adapter
gradient of ``CrossEntropyLoss`` (token mean; gradient accumulation = mean of the calls),
``GRPOLoss`` (per-sequence token mean, then batch mean) and ``DPOLoss`` (mean over pairs +
sft_weight x chosen token mean) against a float64 reference of upstream's formulas written here
(the LoRA deltas as float64 leaves of a functional HF call), while the Tinker names
(``cross_entropy``, ``ppo``, ``dpo``) keep their sums; and the DPO mean over a sliced request."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from engine.backends.lora import adapter_parameters
from engine.protocol import DatumInput, ForwardBackwardInput
from engine.scheduling.slicing import slice_input
from tests.unit.model_api_helpers import LORA, TEXTS, new_model

#: float32 backend vs float64 reference: values relative to max(1, |value|), gradients relative to
#: the reference gradient's norm. Measured here (2026-12-03): gradients 3.7e-7 to 5.6e-7, so 1e-5
#: leaves an 18x margin; a wrong reduction is off by a factor of >= 2
VALUE_TOL, GRAD_TOL = 1e-5, 1e-5


@pytest.fixture(scope="module")
def seqs(tiny_model_dir: Path) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    return [tok(t)["input_ids"] for t in TEXTS]


@pytest.fixture(scope="module")
def model(tiny_model_dir: Path):
    return new_model(tiny_model_dir)


@pytest.fixture(scope="module")
def base64(tiny_model_dir: Path):
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float64).eval()
    ref.lm_head.weight = torch.nn.Parameter(ref.lm_head.weight.detach().clone())  # untie
    return ref


_names = iter(range(10**6))


def adapter(m, seed: int, **kw) -> str:
    """A fresh adapter with random non-zero B (so it is not the base model)."""
    name = f"u{next(_names)}"
    m.add_adapter_to_model(name, dict(LORA, seed=seed), **kw)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for k, p in adapter_parameters(m.backend.model, name).items():
            if "lora_B" in k:
                p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.05)
    return name


def row(seq: list[int], prompt_len: int) -> dict:
    """Upstream's template encoding: labels rolled (labels[i] is the target of input_ids[i])."""
    hf_labels = [-100] * prompt_len + seq[prompt_len:]
    return {"input_ids": list(seq), "labels": hf_labels[1:] + [-100]}


class Ref:
    """float64 reference: the adapter's A / B as leaves, W + (alpha / r) B @ A in a functional
    call of the float64 base model; per-row log p(label) at every position."""

    def __init__(self, m, name: str, base) -> None:
        spec = m.backend.adapter_spec(name)
        self.scale = spec.alpha / spec.rank
        self.base = base
        self.params = adapter_parameters(m.backend.model, name)
        self.leaves = {
            k: p.detach().double().clone().requires_grad_() for k, p in self.params.items()
        }
        self.weights = dict(base.named_parameters())

    def logps(self, r: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """(log p(labels) [n] with gradient to the leaves, mask [n])."""
        over = {}
        for k, a in self.leaves.items():
            if k.endswith("lora_A.weight"):
                b = self.leaves[k.replace("lora_A", "lora_B")]
                name = k[len("base_model.model.") : -len(".lora_A.weight")] + ".weight"
                over[name] = self.weights[name].detach() + self.scale * b @ a
        ids = torch.tensor([r["input_ids"]])
        logits = torch.func.functional_call(self.base, over, (ids,)).logits[0]
        labels = torch.tensor(r["labels"])
        mask = (labels != -100).double()
        lp = torch.log_softmax(logits, -1).gather(-1, labels.clamp(min=0)[:, None])[:, 0]
        return lp, mask

    def grad_of(self, loss: torch.Tensor) -> dict[str, torch.Tensor]:
        grads = torch.autograd.grad(loss, list(self.leaves.values()), retain_graph=True)
        return dict(zip(self.leaves, grads, strict=True))


def ours(m, name: str) -> dict[str, torch.Tensor]:
    return {k: p.grad.double() for k, p in adapter_parameters(m.backend.model, name).items()}


def flat(g: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([g[k].flatten() for k in sorted(g)])


def assert_grad(m, name: str, want: dict[str, torch.Tensor]) -> None:
    got, ref = flat(ours(m, name)), flat(want)
    err = float((got - ref).norm() / ref.norm())
    assert err <= GRAD_TOL, err
    norm = m.clip_grad_norm(1.0, adapter_name=name)  # upstream's normalized grad norm
    assert norm == pytest.approx(float(ref.norm()), rel=GRAD_TOL)


def assert_value(got: float, want: float | torch.Tensor) -> None:
    want = float(want.detach()) if isinstance(want, torch.Tensor) else float(want)
    assert abs(got - want) <= VALUE_TOL * max(1.0, abs(want)), (got, want)


def reset(m, name: str) -> None:
    m.backend.adapter_grad(name, "zero")
    st = m._st(name)
    st.pending_grad, st.micro = False, 0


# ----------------------------------------------------------------------------------- CE
def test_cross_entropy_loss_token_mean_with_accumulation(model, seqs, base64) -> None:
    name = adapter(model, seed=3, gradient_accumulation_steps=2)
    model.set_loss("CrossEntropyLoss", adapter_name=name)
    calls = [[row(seqs[0], 3), row(seqs[1], 6)], [row(seqs[2], 2)]]  # unequal token counts
    ref = Ref(model, name, base64)
    total = 0
    for batch in calls:
        out = model.forward_backward(batch, adapter_name=name)
        parts = [ref.logps(r) for r in batch]
        n = sum(float(mask.sum()) for _, mask in parts)
        mean = sum(-(lp * mask).sum() for lp, mask in parts) / n  # upstream: per-call token mean
        assert_value(out["loss"], mean.detach())
        # loss_sum / num_tokens stay Tinker's sum and token count
        assert out["num_tokens"] == n
        assert_value(out["loss_sum"], float(mean.detach()) * n)
        total = total + mean / len(calls)  # upstream divides the window's gradient by the calls
    assert_grad(model, name, ref.grad_of(total))
    assert model.clip_grad_and_step(1.0, adapter_name=name) is not None

    # Tinker's cross_entropy (and CrossEntropyLoss(reduction='sum')): the sum, gradient too
    for loss, kw in (("cross_entropy", {}), ("CrossEntropyLoss", {"reduction": "sum"})):
        reset(model, name)
        model.set_loss(loss, adapter_name=name, **kw)
        ref = Ref(model, name, base64)
        out = model.forward_backward(calls[0], adapter_name=name)
        parts = [ref.logps(r) for r in calls[0]]
        s = sum(-(lp * mask).sum() for lp, mask in parts)
        assert_value(out["loss_sum"], s)
        assert_value(out["loss"], s / out["num_tokens"])
        assert_grad(model, name, ref.grad_of(s))
    with pytest.raises(Exception, match="reduction 'none'"):
        model.set_loss("CrossEntropyLoss", reduction="none", adapter_name=name)


# ----------------------------------------------------------------------------------- GRPO
def _grpo_inputs(model, name, seqs):
    rows = [row(seqs[0], 4), row(seqs[1], 9), row(seqs[3], 2)]
    lp = model.forward_only(rows, adapter_name=name)["logps"]
    rng = np.random.default_rng(0)
    old = []
    for r, lpr in zip(rows, lp, strict=True):
        trained = [lpr[j] for j, lab in enumerate(r["labels"]) if lab != -100]
        delta = rng.uniform(-0.4, 0.4, len(trained))
        for p in (np.log(1.2), np.log(0.8)):  # keep float32 vs float64 on one clip branch
            close = np.abs(delta - p) < 2e-3
            delta[close] += 6e-3
        old.append((np.asarray(trained) - delta).tolist())
    return rows, old, [1.0, -0.5, 0.7]


def _ppo_per_token(ref, rows, old, adv, eps=0.2):
    out = []
    for r, o, a in zip(rows, old, adv, strict=True):
        lp, mask = ref.logps(r)
        full = torch.zeros_like(lp)
        full[mask.bool()] = torch.tensor(o, dtype=torch.float64)
        ratio = torch.exp(lp - full)
        per = -torch.minimum(ratio * a, ratio.clamp(1 - eps, 1 + eps) * a) * mask
        out.append((per, mask))
    return out


def test_grpo_loss_sequence_mean_then_batch_mean(model, seqs, base64) -> None:
    name = adapter(model, seed=5)
    rows, old, adv = _grpo_inputs(model, name, seqs)  # cross_entropy forward: the sampler's lp
    model.set_loss("GRPOLoss", epsilon=0.2, beta=0.0, adapter_name=name)
    ref = Ref(model, name, base64)
    out = model.forward_backward(rows, adapter_name=name, advantages=adv, old_logps=old)
    per = _ppo_per_token(ref, rows, old, adv)
    want = sum(p.sum() / m.sum() for p, m in per) / len(per)
    assert_value(out["loss"], want)
    assert_value(out["loss_sum"], sum(p.sum() for p, _ in per))  # Tinker's sum
    for e, (p, _) in zip(out["elementwise_loss"], per, strict=True):  # unscaled per-token
        np.testing.assert_allclose(e, p.detach().numpy(), atol=1e-5)
    assert_grad(model, name, ref.grad_of(want))

    # Tinker's ppo: the plain sum
    reset(model, name)
    model.set_loss("ppo", adapter_name=name)
    out = model.forward_backward(rows, adapter_name=name, advantages=adv, old_logps=old)
    total = sum(p.sum() for p, _ in per)
    assert_value(out["loss"], total)
    assert_grad(model, name, ref.grad_of(total))


# ----------------------------------------------------------------------------------- DPO
def _dpo_ref(ref, pairs, ref_logps, beta, sft, mean: bool):
    seq, ref_seq, nll, n_chosen = [], [], 0.0, 0.0
    for i, (r, rl) in enumerate(zip(pairs, ref_logps, strict=True)):
        lp, mask = ref.logps(r)
        seq.append((lp * mask).sum())
        ref_seq.append((torch.tensor(rl, dtype=torch.float64) * mask).sum())
        if i % 2 == 0:
            nll, n_chosen = nll - (lp * mask).sum(), n_chosen + float(mask.sum())
    s, rs = torch.stack(seq), torch.stack(ref_seq)
    margin = beta * ((s[0::2] - rs[0::2]) - (s[1::2] - rs[1::2]))
    pair = -F.logsigmoid(margin)
    if mean:
        return pair.mean() + sft * nll / n_chosen
    return pair.sum() + sft * nll


def test_dpo_loss_pair_mean_and_chosen_token_mean(model, seqs, base64) -> None:
    name = adapter(model, seed=7, gradient_accumulation_steps=2)
    model.set_loss("DPOLoss", beta=0.1, sft_weight=0.5, adapter_name=name)
    calls = [
        [row(seqs[0], 3), row(seqs[1], 3), row(seqs[3], 5), row(seqs[2], 4)],
        [row(seqs[1], 2), row(seqs[2], 6)],
    ]
    ref = Ref(model, name, base64)
    total = 0
    for pairs in calls:
        base_out = model.forward_only(pairs, adapter_name=name, disable_lora=True)
        out = model.forward_backward(pairs, adapter_name=name, ref_outputs=base_out)
        want = _dpo_ref(ref, pairs, base_out["logps"], 0.1, 0.5, mean=True)
        assert_value(out["loss"], want)
        assert out["loss_sum"] == out["loss"]
        assert abs(out["metrics"]["dpo_margin:mean"]) > 1e-4  # not vacuous: policy != reference
        total = total + want / len(calls)
    assert_grad(model, name, ref.grad_of(total))

    # Tinker's dpo: sums over pairs and chosen tokens
    reset(model, name)
    model.set_loss("dpo", beta=0.1, sft_weight=0.5, adapter_name=name)
    pairs = calls[0]
    base_out = model.forward_only(pairs, adapter_name=name, disable_lora=True)
    out = model.forward_backward(pairs, adapter_name=name, ref_outputs=base_out)
    want = _dpo_ref(ref, pairs, base_out["logps"], 0.1, 0.5, mean=False)
    assert_value(out["loss"], want)
    assert_grad(model, name, ref.grad_of(want))


def test_dpo_mean_reduction_is_exact_over_slices(model, seqs) -> None:
    """The scheduler's slices of a paired request carry the whole request's counts, so the
    slices' loss:sum adds up to the unsliced mean."""
    name = adapter(model, seed=9)
    be = model.backend
    rows = [row(s, 3) for s in (seqs[0], seqs[1], seqs[3], seqs[2], seqs[1], seqs[0])]
    data = []
    for r in rows:
        labels = np.asarray(r["labels"])
        lfi = {
            "target_tokens": np.where(labels == -100, 0, labels),
            "weights": (labels != -100).astype(np.float32),
            "ref_logprobs": np.full(len(labels), -3.0, np.float32),
        }
        data.append(DatumInput(r["input_ids"], lfi))
    cfg = {"beta": 0.1, "sft_weight": 0.5, "mean_reduction": 1.0}
    inp = ForwardBackwardInput(data, "dpo", cfg, forward_only=True)
    whole = be.forward_backward(name, inp).metrics["loss:sum"]
    parts = slice_input(inp, 16)
    assert len(parts) == 3
    assert all(p.loss_fn_config["num_pairs"] == 3.0 for p, _ in parts)
    sliced = sum(be.forward_backward(name, p).metrics["loss:sum"] for p, _ in parts)
    assert sliced == pytest.approx(whole, rel=1e-6)
    # without the counts each slice would divide by its own pair: 3x the pair term
    alone = [
        be.forward_backward(name, ForwardBackwardInput(p.data, "dpo", cfg, forward_only=True))
        for p, _ in parts
    ]
    assert sum(a.metrics["loss:sum"] for a in alone) > 1.5 * whole


def test_reported_metrics_and_configs_saved_before_upstream_mean(model, seqs) -> None:
    name = adapter(model, seed=11, gradient_accumulation_steps=2)
    model.set_loss("CrossEntropyLoss", adapter_name=name)
    calls = [[row(seqs[0], 3)], [row(seqs[1], 3), row(seqs[2], 3)]]
    outs = [model.forward_backward(b, adapter_name=name) for b in calls]
    for out in outs:  # metrics' loss:sum is upstream's value too, not the scaled backend sum
        assert out["metrics"]["loss:sum"] == out["loss"]
    # calculate_metric: the mean of the calls' losses, as upstream's LossMetric
    got = model.calculate_metric(is_training=True, adapter_name=name)["loss"]
    assert got == pytest.approx((outs[0]["loss"] + outs[1]["loss"]) / 2)
    # a train config written before upstream_mean existed restores upstream's default reduction
    st = model._st(name)
    cfg = st.train_config()
    cfg["loss"] = {"name": "CrossEntropyLoss", "loss_fn": "cross_entropy", "config": {}}
    st.restore_train_config(cfg)
    assert st.loss[2] == {"upstream_mean": 1.0}
