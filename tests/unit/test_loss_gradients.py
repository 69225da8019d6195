"""Every loss's gradient against its formula: d loss / d logprobs by hand (float64), and the
adapter gradient equal to a cross-entropy with the formula's per-token weights.

Inputs are fresh random draws each run (seed printed in failure messages; set TWINKLE_TEST_SEED to
replay one)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from engine.backends.lora import adapter_parameters
from engine.backends.losses import LOSSES
from engine.backends.train_transformers import TransformersTrainingBackend
from engine.protocol import (
    DatumInput,
    ForwardBackwardInput,
    ForwardBackwardOutput,
)
from tests.unit.losses_helpers import (
    CLIP,
    IDS,
    SEED,
    TOKEN_LOSSES,
    away_from,
    clear,
    make_backend,
    make_data,
    merged_f64,
)


@pytest.fixture(scope="module")
def rng() -> np.random.Generator:
    return np.random.default_rng(SEED)


@pytest.fixture(scope="module")
def be(tiny_model_dir: Path, rng) -> TransformersTrainingBackend:
    return make_backend(tiny_model_dir, rng)


@pytest.fixture(scope="module")
def refs(tiny_model_dir: Path, be) -> dict[str | None, nn.Module]:
    return {aid: merged_f64(tiny_model_dir, be, aid) for aid in (*IDS, None)}


def analytic_grad(loss: str, lp, old, adv, cfg, mask=None) -> np.ndarray:
    """d loss / d lp of one token, from the formula by hand (float64)."""
    ratio = np.exp(lp - old)
    if loss == "gspo":  # every token: the sequence ratio s, with d s_t / d lp_t = s
        s = np.exp(np.mean((lp - old)[mask != 0]))
        lo, hi = cfg
        return np.where(np.where(adv >= 0, s < hi, s > lo), -s * adv, 0.0)
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
    mask = (rng.random(n) < 0.5).astype(np.float64)
    inputs = {
        "sequence_ratio_mask": torch.tensor(mask, dtype=torch.float32),
        "logprobs": torch.tensor(old, dtype=torch.float32),
        "advantages": torch.tensor(adv, dtype=torch.float32),
        "weights": torch.tensor(adv, dtype=torch.float32),
    }
    spec = LOSSES[loss]
    spec.per_token(x, inputs, dict(spec.config)).sum().backward()
    want = analytic_grad(loss, lp, old, adv, (lo, hi), mask)
    np.testing.assert_allclose(x.grad.numpy(), want, atol=1e-5, rtol=1e-5, err_msg=f"seed {SEED}")
    if loss == "ppo":  # both branches exercised
        assert (want == 0).sum() > 20 and (want != 0).sum() > 20
    if loss == "cispo":
        assert (np.exp(log_ratio) > hi).sum() > 20


@pytest.mark.parametrize("loss", ["ppo", "cispo", "gspo"])
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
            g = analytic_grad(
                loss, lp, x["logprobs"], x["advantages"], CLIP[loss], x.get("sequence_ratio_mask")
            )
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
