"""Every loss against a float64 reference of its documented formula, run through the fused path.

Inputs are fresh random draws each run (seed printed in failure messages; set TWINKLE_TEST_SEED to
replay one). The reference is the HF model in float64 with each adapter's B @ A * scaling merged
into a copy of the base weights, then the formula of shared/docs/tinker-protocol.md §11 in numpy.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from engine.backends.lora import adapter_parameters
from engine.backends.losses import LOSSES
from engine.backends.train_transformers import TransformersTrainingBackend
from engine.errors import UserInputError
from engine.protocol import (
    AdamParams,
    DatumInput,
    ForwardBackwardInput,
    ForwardBackwardOutput,
    LoraSpec,
)

SEED = int(os.environ.get("TWINKLE_TEST_SEED") or int.from_bytes(os.urandom(4), "little"))
RANKS = (2, 4, 8)
IDS = tuple(f"r{r}" for r in RANKS)
VOCAB = 2048
TOKEN_LOSSES = ("cross_entropy", "importance_sampling", "ppo", "cispo", "dro")
CLIP = {"ppo": (0.8, 1.2), "cispo": (0.0, 4.0)}


@pytest.fixture(scope="module")
def rng() -> np.random.Generator:
    return np.random.default_rng(SEED)


@pytest.fixture(scope="module")
def be(tiny_model_dir: Path, rng) -> TransformersTrainingBackend:
    """Three adapters of ranks 2, 4, 8 with random non-zero B (so LoRA changes the logprobs)."""
    b = TransformersTrainingBackend(str(tiny_model_dir))
    for k, (aid, r) in enumerate(zip(IDS, RANKS, strict=True)):
        b.create_adapter(aid, LoraSpec(rank=r, alpha=2.0 * r, seed=k))
        with torch.no_grad():
            for name, p in adapter_parameters(b.model, aid).items():
                if "lora_B" in name:
                    p.copy_(torch.from_numpy(rng.normal(0.0, 0.05, tuple(p.shape))))
    return b


def merged_f64(model_dir: Path, be, aid: str | None) -> nn.Module:
    """float64 HF model, with adapter ``aid``'s delta W = B @ A * scaling merged (None: base)."""
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64).eval()
    ref.lm_head.weight = nn.Parameter(ref.lm_head.weight.detach().clone())  # untie
    if aid is not None:
        spec = be.adapter_spec(aid)
        params = adapter_parameters(be.model, aid)
        with torch.no_grad():
            for key, a in params.items():
                if key.endswith("lora_A.weight"):
                    b = params[key.replace("lora_A", "lora_B")]
                    name = key[len("base_model.model.") : -len(".lora_A.weight")]
                    delta = (spec.alpha / spec.rank) * b.double() @ a.double()
                    ref.get_submodule(name).weight += delta
    return ref


@pytest.fixture(scope="module")
def refs(tiny_model_dir: Path, be) -> dict[str | None, nn.Module]:
    return {aid: merged_f64(tiny_model_dir, be, aid) for aid in (*IDS, None)}


def ref_logprobs(model: nn.Module, tokens: list[int], targets: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        lp = torch.log_softmax(model(torch.tensor([tokens])).logits[0], -1)
    return lp[torch.arange(len(tokens)), torch.from_numpy(targets)].numpy()


def away_from(delta: np.ndarray, rng, points: tuple[float, ...], width: float = 2e-3):
    """Redraw log-ratios within ``width`` of a clip point, so float32 vs float64 cannot flip a
    clipping branch."""
    for p in points:
        close = np.abs(delta - p) < width
        delta[close] += np.where(rng.random(close.sum()) < 0.5, -3 * width, 3 * width)
    return delta


def make_data(rng, loss: str, model: nn.Module, n_datums: int) -> tuple[list[DatumInput], list]:
    """Random datums for ``loss`` and their float64 learner logprobs under ``model``."""
    data, lps = [], []
    for _ in range(n_datums):
        n = int(rng.integers(5, 24))
        tokens = rng.integers(0, VOCAB, n).tolist()
        targets = rng.integers(0, VOCAB, n)
        lp = ref_logprobs(model, tokens, targets)
        lfi: dict[str, np.ndarray] = {"target_tokens": targets}
        lfi["weights"] = rng.normal(size=n).astype(np.float32)
        if loss == "dpo":
            lfi["weights"] = (rng.random(n) < 0.7).astype(np.float32)  # response-token mask
        if loss in TOKEN_LOSSES[1:]:
            lo, hi = CLIP.get(loss, (0.8, 1.2))
            spread = (-0.6, 1.6) if loss == "cispo" else (-0.4, 0.4)
            log_ratio = away_from(rng.uniform(*spread, n), rng, (np.log(hi), np.log(max(lo, 1e-9))))
            lfi["logprobs"] = (lp - log_ratio).astype(np.float32)  # ratio = exp(lp - old)
            lfi["advantages"] = rng.normal(size=n).astype(np.float32)
        data.append(DatumInput(tokens=tokens, loss_fn_inputs=lfi))
        lps.append(lp)
    return data, lps


def reference(loss: str, data: list[DatumInput], lps: list, cfg: dict, base=None):
    """(per-datum elementwise loss or None, loss sum, extra metrics) in float64 numpy."""
    f64 = [{k: np.asarray(v, np.float64) for k, v in d.loss_fn_inputs.items()} for d in data]
    if loss == "dpo":
        beta, sft = cfg.get("beta", 0.1), cfg.get("sft_weight", 0.0)
        s = [np.sum(lp * x["weights"]) for lp, x in zip(lps, f64, strict=True)]
        r = [
            np.sum(x.get("ref_logprobs", b) * x["weights"])
            for x, b in zip(f64, base or [None] * len(data), strict=True)
        ]
        margins = np.array(
            [beta * ((s[i] - r[i]) - (s[i + 1] - r[i + 1])) for i in range(0, len(s), 2)]
        )
        nll = float(np.sum(np.logaddexp(0.0, -margins)))  # -logsigmoid
        total = nll + sft * float(sum(-s[i] for i in range(0, len(s), 2)))
        extra = {
            "dpo_accuracy:mean": float(np.mean(margins > 0)),
            "dpo_margin:mean": float(margins.mean()),
        }
        return None, total, extra
    per = []
    for lp, x in zip(lps, f64, strict=True):
        if loss == "cross_entropy":
            per.append(-lp * x["weights"])
            continue
        old, adv = x["logprobs"], x["advantages"]
        ratio = np.exp(lp - old)
        if loss == "importance_sampling":
            per.append(-ratio * adv)
        elif loss == "ppo":
            lo, hi = cfg.get("clip_low_threshold", 0.8), cfg.get("clip_high_threshold", 1.2)
            per.append(-np.minimum(ratio * adv, np.clip(ratio, lo, hi) * adv))
        elif loss == "cispo":
            lo, hi = cfg.get("clip_low_threshold", 0.0), cfg.get("clip_high_threshold", 4.0)
            per.append(-np.clip(ratio, lo, hi) * lp * adv)
        elif loss == "dro":
            beta = cfg.get("beta", 0.05)
            per.append(-(lp * adv - 0.5 * beta * (lp - old) ** 2))
    return per, float(sum(p.sum() for p in per)), {}


def close(actual: float, expected: float, scale: float, what: str) -> None:
    tol = 1e-5 * max(1.0, scale)
    assert abs(actual - expected) <= tol, f"{what}: {actual} vs {expected} (seed {SEED})"


def clear(be) -> None:
    """Drop pending gradients without changing parameters (AdamW with lr 0)."""
    for aid in IDS:
        if be.has_pending_grad(aid):
            be.optim_step(aid, AdamParams(learning_rate=0.0))


CONFIGS = [
    ("cross_entropy", {}),
    ("importance_sampling", {}),
    ("ppo", {}),
    ("ppo", {"clip_low_threshold": "0.9", "clip_high_threshold": 1.1}),
    ("cispo", {}),
    ("dro", {}),
    ("dro", {"beta": 0.5}),
    ("dpo", {}),
    ("dpo", {"beta": 0.5, "sft_weight": 0.25}),
]


@pytest.mark.parametrize(("loss", "cfg"), CONFIGS)
def test_fused_loss_matches_float64_reference(be, refs, rng, loss, cfg) -> None:
    items, expect = [], {}
    for aid in IDS:
        data, lps = make_data(rng, loss, refs[aid], 4)
        if loss == "dpo":  # explicit reference logprobs (the base-model case is tested below)
            for d in data:
                n = len(d.tokens)
                d.loss_fn_inputs["ref_logprobs"] = rng.normal(-7.0, 1.0, n).astype(np.float32)
        items.append((aid, ForwardBackwardInput(data=data, loss_fn=loss, loss_fn_config=cfg)))
        num_cfg = {k: float(v) for k, v in cfg.items()}
        expect[aid] = (lps, *reference(loss, data, lps, num_cfg))
    results = be.forward_backward_many(items)
    clear(be)
    for (aid, _), out in zip(items, results, strict=True):
        assert isinstance(out, ForwardBackwardOutput), out
        lps, per, total, extra = expect[aid]
        for i, (o, lp) in enumerate(zip(out.outputs, lps, strict=True)):
            assert o["logprobs"].dtype == np.float32 and o["logprobs"].shape == lp.shape
            np.testing.assert_allclose(o["logprobs"], lp, atol=1e-5, rtol=0, err_msg=f"seed {SEED}")
            if per is None:
                assert "elementwise_loss" not in o
            else:
                scale = np.abs(per[i]).max()
                np.testing.assert_allclose(
                    o["elementwise_loss"],
                    per[i],
                    atol=1e-5 * max(1, scale),
                    rtol=0,
                    err_msg=f"{aid} datum {i} seed {SEED}",
                )
        scale = sum(np.abs(p).sum() for p in per) if per is not None else abs(total)
        close(out.metrics["loss:sum"], total, scale, f"{loss} {aid} loss:sum")
        assert set(out.metrics) == {"loss:sum", *extra}
        margin_scale = float(cfg.get("beta", 0.1)) * sum(np.abs(lp).sum() for lp in lps)
        for k, v in extra.items():
            close(out.metrics[k], v, margin_scale, f"{aid} {k}")


def test_lora_changes_logprobs(be, refs, rng) -> None:
    """Guard for the test above: the perturbed adapters really differ from the base model."""
    data, base = make_data(rng, "cross_entropy", refs[None], 1)
    for aid in IDS:
        lp = ref_logprobs(refs[aid], data[0].tokens, data[0].loss_fn_inputs["target_tokens"])
        assert np.abs(lp - base[0]).max() > 1e-2


def test_dpo_without_ref_logprobs_uses_base_model(be, refs, rng) -> None:
    items, expect = [], {}
    for aid in IDS:
        data, lps = make_data(rng, "dpo", refs[aid], 4)
        base = [ref_logprobs(refs[None], d.tokens, d.loss_fn_inputs["target_tokens"]) for d in data]
        items.append((aid, ForwardBackwardInput(data=data, loss_fn="dpo")))
        expect[aid] = reference("dpo", data, lps, {}, base=base)
    results = be.forward_backward_many(items)
    clear(be)
    for (aid, _), out in zip(items, results, strict=True):
        _, total, extra = expect[aid]
        assert isinstance(out, ForwardBackwardOutput), out
        close(out.metrics["loss:sum"], total, abs(total), f"{aid} loss:sum")
        close(out.metrics["dpo_margin:mean"], extra["dpo_margin:mean"], 10, f"{aid} margin")
        assert out.metrics["dpo_accuracy:mean"] == pytest.approx(extra["dpo_accuracy:mean"])


@pytest.mark.parametrize("flag", [1, 1.0, "true", True])
def test_disable_lora_gives_base_logprobs(tiny_model_dir: Path, be, refs, rng, flag) -> None:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    data, _ = make_data(rng, "cross_entropy", refs[None], 3)
    cfg = {"disable_lora": flag}
    items = [
        (aid, ForwardBackwardInput(data, loss_fn_config=cfg, forward_only=True)) for aid in IDS
    ]
    items.append(("r2", ForwardBackwardInput(data, forward_only=True)))  # same adapter twice: no
    with pytest.raises(ValueError, match="more than once"):
        be.forward_backward_many(items)
    results = be.forward_backward_many(items[:3])
    with_lora = be.forward_backward("r2", ForwardBackwardInput(data, forward_only=True))
    for out in results:
        for d, o, lo in zip(data, out.outputs, with_lora.outputs, strict=True):
            with torch.no_grad():
                lp = torch.log_softmax(hf(torch.tensor([d.tokens])).logits[0], -1)
            tgt = d.loss_fn_inputs["target_tokens"]
            np.testing.assert_allclose(o["logprobs"], lp[np.arange(len(tgt)), tgt], atol=1e-5)
            assert np.abs(o["logprobs"] - lo["logprobs"]).max() > 1e-3
    assert not any(be.has_pending_grad(aid) for aid in IDS)
    with pytest.raises(UserInputError, match="disable_lora: only allowed with forward_only"):
        be.forward_backward("r2", ForwardBackwardInput(data, loss_fn_config=cfg))


def analytic_grad(loss: str, lp, old, adv, cfg) -> np.ndarray:
    """d loss / d lp of one token, from the formula by hand (float64)."""
    ratio = np.exp(lp - old)
    if loss == "cross_entropy":
        return -adv  # (adv plays the weights)
    if loss == "importance_sampling":
        return -ratio * adv
    if loss == "ppo":
        lo, hi = cfg
        unclipped = np.where(adv >= 0, ratio < hi, ratio > lo)  # the min picks ratio * A
        return np.where(unclipped, -ratio * adv, 0.0)
    if loss == "cispo":
        return -np.clip(ratio, *cfg) * adv
    return -(adv - 0.05 * (lp - old))  # dro, beta 0.05


@pytest.mark.parametrize("loss", TOKEN_LOSSES)
def test_gradient_wrt_logprobs_matches_formula(rng, loss) -> None:
    n = 400
    lp = rng.uniform(-8, -0.1, n).astype(np.float32).astype(np.float64)
    lo, hi = CLIP.get(loss, (0.8, 1.2))
    top = 2.5 if loss == "cispo" else 1.6  # about a quarter of the ratios above cispo's 4.0
    log_ratio = away_from(rng.uniform(-1.6, top, n), rng, (np.log(hi), np.log(max(lo, 1e-9))))
    old = (lp - log_ratio).astype(np.float32).astype(np.float64)
    adv = rng.normal(size=n).astype(np.float32).astype(np.float64)
    x = torch.tensor(lp, dtype=torch.float32, requires_grad=True)
    inputs = {
        "logprobs": torch.tensor(old, dtype=torch.float32),
        "advantages": torch.tensor(adv, dtype=torch.float32),
        "weights": torch.tensor(adv, dtype=torch.float32),
    }
    spec = LOSSES[loss]
    spec.per_token(x, inputs, dict(spec.config)).sum().backward()
    want = analytic_grad(loss, lp, old, adv, (lo, hi))
    np.testing.assert_allclose(x.grad.numpy(), want, atol=1e-5, rtol=1e-5, err_msg=f"seed {SEED}")
    if loss == "ppo":  # both branches exercised
        assert (want == 0).sum() > 20 and (want != 0).sum() > 20
    if loss == "cispo":
        assert (np.exp(log_ratio) > hi).sum() > 20


@pytest.mark.parametrize("loss", ["ppo", "cispo"])
def test_adapter_gradient_equals_cross_entropy_with_formula_weights(be, refs, rng, loss) -> None:
    """End to end: the adapter gradient of an RL loss equals that of cross_entropy with
    weights = -dL/dlp (the chain rule), dL/dlp taken from the float64 formula."""
    clear(be)
    items, ce_items = [], []
    for aid in IDS:
        data, lps = make_data(rng, loss, refs[aid], 3)
        items.append((aid, ForwardBackwardInput(data=data, loss_fn=loss)))
        ce = []
        for d, lp in zip(data, lps, strict=True):
            x = d.loss_fn_inputs
            g = analytic_grad(loss, lp, x["logprobs"], x["advantages"], CLIP[loss])
            ce.append(DatumInput(d.tokens, {"target_tokens": x["target_tokens"], "weights": -g}))
        ce_items.append((aid, ForwardBackwardInput(data=ce)))

    def grads(batch):
        assert all(isinstance(o, ForwardBackwardOutput) for o in be.forward_backward_many(batch))
        out = {
            (aid, k): p.grad.clone()
            for aid in IDS
            for k, p in adapter_parameters(be.model, aid).items()
        }
        clear(be)
        return out

    g_rl, g_ce = grads(items), grads(ce_items)
    for key, g in g_rl.items():
        scale = float(g_ce[key].abs().max())
        assert float((g - g_ce[key]).abs().max()) <= 1e-5 * max(1.0, scale), (key, SEED)


@pytest.mark.parametrize(
    ("loss", "lfi_drop", "cfg", "n", "message"),
    [
        (
            "nope",
            (),
            {},
            2,
            "unknown loss_fn 'nope'; known: cispo, cross_entropy, dpo, dro, importance_sampling, ppo",
        ),
        (
            "ppo",
            ("advantages",),
            {},
            2,
            "data[1].loss_fn_inputs.advantages: required by loss_fn 'ppo'",
        ),
        (
            "importance_sampling",
            ("logprobs",),
            {},
            2,
            "data[1].loss_fn_inputs.logprobs: required by loss_fn 'importance_sampling'",
        ),
        (
            "ppo",
            (),
            {"clip_low": 0.5},
            2,
            (
                "loss_fn_config.clip_low: unknown key for loss_fn 'ppo'; "
                "accepted: clip_high_threshold, clip_low_threshold, disable_lora"
            ),
        ),
        ("cross_entropy", (), {"beta": 1}, 2, "accepted: disable_lora"),
        ("ppo", (), {"clip_low_threshold": "x"}, 2, "loss_fn_config.clip_low_threshold: 'x' must"),
        ("ppo", (), {"clip_low_threshold": 1.5}, 2, "clip_low_threshold <= clip_high_threshold"),
        ("dpo", (), {}, 3, "data: loss_fn 'dpo' takes (chosen, rejected) pairs"),
    ],
)
def test_loss_input_errors_name_the_field(be, rng, loss, lfi_drop, cfg, n, message) -> None:
    data, _ = make_data(rng, "ppo", _Zero(), n)
    for k in lfi_drop:
        data[1].loss_fn_inputs.pop(k)
    [err] = be.forward_backward_many([("r4", ForwardBackwardInput(data, loss, cfg))])
    assert isinstance(err, UserInputError) and message in str(err), str(err)
    assert not be.has_pending_grad("r4")


def test_wrong_shape_advantages_and_two_d_targets_for_rl(be, rng) -> None:
    data, _ = make_data(rng, "ppo", _Zero(), 1)
    n = len(data[0].tokens)
    data[0].loss_fn_inputs["advantages"] = np.zeros(n + 1, np.float32)
    with pytest.raises(UserInputError, match=rf"advantages: shape \[{n + 1}\] must be \[{n}\]"):
        be.forward_backward("r2", ForwardBackwardInput(data, "ppo"))
    data[0].loss_fn_inputs["advantages"] = np.zeros(n, np.float32)
    data[0].loss_fn_inputs["target_tokens"] = np.zeros((n, 2), np.int64)
    with pytest.raises(UserInputError, match="target_tokens: shape .* must be .*loss_fn 'ppo'"):
        be.forward_backward("r2", ForwardBackwardInput(data, "ppo"))


class _Zero(nn.Module):
    """Stand-in model for inputs whose logprobs do not matter (validation tests)."""

    def forward(self, ids):
        return type("Out", (), {"logits": torch.zeros(*ids.shape, VOCAB, dtype=torch.float64)})
