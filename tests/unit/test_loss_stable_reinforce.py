"""``stable_reinforce`` on the real Transformers backend and the tiny model, against a float64
reference of its formula (engine/backends/losses.py): the loss, its gradient (one AdamW-free
check: the gradient of a masked token is zero, of a kept one ``-r * A * grad(lp)``), both masking
rules and their metrics, the knobs' bounds and the refusal of advantages on unsampled tokens.

The reference learner logprobs are the float64 model with each adapter merged
(tests/unit/losses_helpers.py); the recorded sampler logprobs are ``lp - log_ratio`` with the
log-ratios drawn away from the band edges, so float32 vs float64 cannot flip a masking branch."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from torch import nn

from engine.backends.train_transformers import TransformersTrainingBackend
from engine.errors import UserInputError
from engine.protocol import DatumInput, ForwardBackwardInput, ForwardBackwardOutput
from tests.unit.losses_helpers import (
    IDS,
    SEED,
    VOCAB,
    away_from,
    clear,
    close,
    make_backend,
    merged_f64,
    ref_logprobs,
)

DEFAULTS = {
    "token_mask_low": 0.5,
    "token_mask_high": 2.0,
    "seq_mask_low": 0.9,
    "seq_mask_high": 1.1,
}


@pytest.fixture(scope="module")
def rng() -> np.random.Generator:
    return np.random.default_rng(SEED)


@pytest.fixture(scope="module")
def be(tiny_model_dir: Path, rng) -> TransformersTrainingBackend:
    return make_backend(tiny_model_dir, rng)


@pytest.fixture(scope="module")
def refs(tiny_model_dir: Path, be) -> dict[str | None, nn.Module]:
    return {aid: merged_f64(tiny_model_dir, be, aid) for aid in IDS}


def _datum(rng, model: nn.Module, seq_shift: float, spread: float, cfg: dict):
    """A datum: a prompt of 3-6 positions (mask 0, advantage 0), then sampled positions whose
    log-ratios are ``seq_shift`` plus zero-mean uniform noise of half-width ``spread`` (so the
    geometric-mean ratio is about ``exp(seq_shift)``)."""
    n_prompt, n = int(rng.integers(3, 7)), int(rng.integers(10, 24))
    tokens = rng.integers(0, VOCAB, n).tolist()
    targets = rng.integers(0, VOCAB, n)
    lp = ref_logprobs(model, tokens, targets)
    mask = np.r_[np.zeros(n_prompt), np.ones(n - n_prompt)].astype(np.float32)
    edges = (np.log(cfg["token_mask_low"]), np.log(cfg["token_mask_high"]))
    sampled = mask != 0
    noise = rng.uniform(-spread, spread, n)
    log_ratio = away_from(seq_shift + noise - noise[sampled].mean(), rng, edges)
    geo = log_ratio[sampled].mean()  # keep the geometric mean away from the sequence band edges
    for edge in (np.log(cfg["seq_mask_low"]), np.log(cfg["seq_mask_high"])):
        if abs(geo - edge) < 2e-3:
            log_ratio[sampled] += 6e-3
    adv = np.where(sampled, rng.normal(size=n), 0.0).astype(np.float32)
    q = np.where(sampled, lp - log_ratio, 0.0).astype(np.float32)
    inputs = {
        "target_tokens": targets,
        "advantages": adv,
        "recorded_logprobs": q,
        "recorded_mask": mask,
    }
    return DatumInput(tokens=tokens, loss_fn_inputs=inputs), lp


def _reference(data: list[DatumInput], lps: list[np.ndarray], cfg: dict):
    """(per-datum elementwise loss, metrics) in float64."""
    per, masked, seq_masked, n_tot, ratio_sum, kl_sum = [], 0, 0, 0, 0.0, 0.0
    for d, lp in zip(data, lps, strict=True):
        x = {k: np.asarray(v, np.float64) for k, v in d.loss_fn_inputs.items()}
        s = x["recorded_mask"] != 0
        r = np.exp(lp - x["recorded_logprobs"])
        keep = s & (r >= cfg["token_mask_low"]) & (r <= cfg["token_mask_high"])
        geo = np.exp(np.mean((lp - x["recorded_logprobs"])[s]))
        if not cfg["seq_mask_low"] <= geo <= cfg["seq_mask_high"]:
            keep[:] = False
            seq_masked += 1
        per.append(-np.where(keep, r, 0.0) * lp * x["advantages"])
        n_tot += int(s.sum())
        masked += int(s.sum() - keep.sum())
        ratio_sum += float(r[s].sum())
        kl_sum += float((r[s] - 1 - np.log(r[s])).sum())
    metrics = {
        "sr_masked_frac:mean": masked / n_tot,
        "sr_seq_masked_frac:mean": seq_masked / len(data),
        "sr_ratio:mean": ratio_sum / n_tot,
        "sr_kl:mean": kl_sum / n_tot,
        "sr_sampled_tokens:sum": float(n_tot),
    }
    return per, metrics


@pytest.mark.parametrize(
    "cfg",
    [
        DEFAULTS,
        {
            "token_mask_low": 0.8,
            "token_mask_high": "1.25",
            "seq_mask_low": 0.5,
            "seq_mask_high": 2.0,
        },
    ],
)
def test_matches_float64_reference_and_masks(be, refs, rng, cfg) -> None:
    """Three datums per adapter: near on-policy (a few tokens leave the band), one shifted so
    its geometric mean leaves the sequence band, one spread wide (many tokens masked)."""
    full = {k: float(v) for k, v in {**DEFAULTS, **cfg}.items()}
    items, expect = [], {}
    for aid in IDS:
        shapes = [(0.0, 0.9), (0.6, 0.2), (0.0, 2.0)]
        pairs = [_datum(rng, refs[aid], s, w, full) for s, w in shapes]
        data, lps = [p[0] for p in pairs], [p[1] for p in pairs]
        items.append(
            (aid, ForwardBackwardInput(data, loss_fn="stable_reinforce", loss_fn_config=cfg))
        )
        expect[aid] = (lps, *_reference(data, lps, full))
    results = be.forward_backward_many(items)
    clear(be)
    for (aid, _), out in zip(items, results, strict=True):
        assert isinstance(out, ForwardBackwardOutput), out
        lps, per, metrics = expect[aid]
        for i, (o, lp) in enumerate(zip(out.outputs, lps, strict=True)):
            np.testing.assert_allclose(o["logprobs"], lp, atol=1e-5, err_msg=f"seed {SEED}")
            np.testing.assert_allclose(
                o["elementwise_loss"], per[i], atol=1e-5 * max(1, np.abs(per[i]).max()),
                err_msg=f"{aid} datum {i} seed {SEED}",
            )  # fmt: skip
        total = float(sum(p.sum() for p in per))
        close(out.metrics["loss:sum"], total, sum(np.abs(p).sum() for p in per), f"{aid} loss")
        assert set(out.metrics) == {"loss:sum", *metrics}
        for k, v in metrics.items():
            close(out.metrics[k], v, 1.0, f"{aid} {k}")
        # the masking really happened: the shifted datum is masked whole under the defaults
        assert 0 < out.metrics["sr_masked_frac:mean"] < 1
        if full["seq_mask_high"] < 1.5:
            assert out.metrics["sr_seq_masked_frac:mean"] > 0
            assert not np.any(out.outputs[1]["elementwise_loss"]), "a masked datum has no loss"


def test_masked_tokens_get_no_gradient(be, refs, rng) -> None:
    """A datum whose every sampled token leaves the band gives zero gradient; the same datum
    with its ratios inside the band gives a nonzero one."""
    aid = IDS[0]
    d, lp = _datum(rng, refs[aid], 0.0, 0.1, DEFAULTS)
    x = d.loss_fn_inputs
    far = dict(
        x, recorded_logprobs=np.where(x["recorded_mask"] != 0, lp - 3.0, 0).astype(np.float32)
    )
    for inputs, moves in ((far, False), (x, True)):
        clear(be)
        inp = ForwardBackwardInput(
            [DatumInput(tokens=d.tokens, loss_fn_inputs=inputs)],
            loss_fn="stable_reinforce",
            loss_fn_config={"seq_mask_low": 0.0, "seq_mask_high": 1e9},
        )
        out = be.forward_backward(aid, inp)
        assert out.metrics["sr_masked_frac:mean"] == (0.0 if moves else 1.0)
        norm = be.adapter_grad(aid, "norm")
        assert norm is not None and (norm > 0) == moves, norm
    clear(be)


@pytest.mark.parametrize(
    ("mutate", "cfg", "message"),
    [
        (
            lambda x: x["advantages"].__setitem__(0, 1.0),
            {},
            "data[0].loss_fn_inputs.advantages: nonzero at position 0, which no "
            "SampledProvenanceSpan",
        ),
        (lambda x: x.pop("recorded_mask"), {}, "data[0].loss_fn_inputs.recorded_mask: required"),
        (
            lambda x: None,
            {"token_mask_low": 1.5},
            "need 0 <= token_mask_low <= 1 <= token_mask_high",
        ),
        (lambda x: None, {"seq_mask_high": 0.99}, "need 0 <= seq_mask_low <= 1 <= seq_mask_high"),
        (
            lambda x: None,
            {"clip_low_threshold": 0.5},
            "loss_fn_config.clip_low_threshold: unknown key",
        ),
    ],
)
def test_input_errors_name_the_field(be, refs, rng, mutate, cfg, message) -> None:
    d, _ = _datum(rng, refs[IDS[0]], 0.0, 0.1, DEFAULTS)
    mutate(d.loss_fn_inputs)
    inp = ForwardBackwardInput([d], loss_fn="stable_reinforce", loss_fn_config=cfg)
    with pytest.raises(UserInputError) as err:
        be.forward_backward(IDS[0], inp)
    assert message in str(err.value)
    assert not be.has_pending_grad(IDS[0])
