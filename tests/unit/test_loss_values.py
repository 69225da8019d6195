"""Every loss against a float64 reference of its documented formula, run through the fused path:
loss values and logprobs, LoRA on and off, DPO without reference logprobs, and input errors that
name the field.

Inputs are fresh random draws each run (seed printed in failure messages; set TWINKLE_TEST_SEED to
replay one). The reference is the HF model in float64 with each adapter's B @ A * scaling merged
into a copy of the base weights, then the formula of shared/docs/tinker-protocol.md §11 in numpy."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from engine.backends.train_transformers import TransformersTrainingBackend
from engine.errors import UserInputError
from engine.protocol import (
    ForwardBackwardInput,
    ForwardBackwardOutput,
)
from tests.unit.losses_helpers import (
    CONFIGS,
    IDS,
    SEED,
    _Zero,
    clear,
    close,
    make_backend,
    make_data,
    merged_f64,
    ref_logprobs,
    reference,
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


@pytest.mark.parametrize(
    ("loss", "lfi_drop", "cfg", "n", "message"),
    [
        (
            "nope",
            (),
            {},
            2,
            "unknown loss_fn 'nope'; known: cispo, cross_entropy, dpo, dro, gspo, "
            "importance_sampling, ppo",
        ),
        (
            "gspo",
            (),
            {},
            2,
            "data[0].loss_fn_inputs.sequence_ratio_mask: required by loss_fn 'gspo'",
        ),
        (
            "stable_reinforce",
            (),
            {},
            2,
            "data[0].loss_fn_inputs.recorded_logprobs: required by loss_fn 'stable_reinforce'",
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


def test_gspo_mask_that_marks_no_token_is_refused(be, rng) -> None:
    data, _ = make_data(rng, "gspo", _Zero(), 2)
    data[1].loss_fn_inputs["sequence_ratio_mask"][:] = 0.0
    with pytest.raises(
        UserInputError, match=r"data\[1\].loss_fn_inputs.sequence_ratio_mask: marks no"
    ):
        be.forward_backward("r2", ForwardBackwardInput(data, "gspo"))
    assert not be.has_pending_grad("r2")


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
