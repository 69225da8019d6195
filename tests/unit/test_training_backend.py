"""TransformersTrainingBackend forward passes: Tinker cross_entropy against a float64 reference,
padding and micro-batching, top-k targets, default weights, validation (training steps,
checkpoints and adapters: test_training_backend_steps.py)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from engine.errors import UserInputError
from engine.protocol import AdamParams, DatumInput, ForwardBackwardInput, LoraSpec
from tests.unit.training_backend_helpers import (
    TEXTS,
    assert_logprobs_close,
    backend,
    datum,
    fb,
    reference_logprobs,
)


@pytest.fixture(scope="module")
def seqs(tiny_model_dir: Path) -> list[np.ndarray]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    return [np.array(tok(t)["input_ids"], dtype=np.int64) for t in TEXTS]


def test_cross_entropy_matches_float64_reference(tiny_model_dir: Path, seqs) -> None:
    be = backend(tiny_model_dir)
    be.create_adapter("a", LoraSpec(rank=4, alpha=8.0, seed=1))
    for _ in range(2):  # make B non-zero so the reference checks the LoRA path too
        fb(be, "a", [datum(s) for s in seqs])
        be.optim_step("a", AdamParams(learning_rate=1e-2))
    rng = np.random.default_rng(0)
    weights = [rng.normal(size=len(s) - 1).astype(np.float32) for s in seqs]  # real-valued, signed
    out = fb(be, "a", [datum(s, w) for s, w in zip(seqs, weights, strict=True)], forward_only=True)
    total = 0.0
    for s, w, o in zip(seqs, weights, out.outputs, strict=True):
        ref = reference_logprobs(tiny_model_dir, be, "a", s[:-1].tolist(), s[1:].tolist())
        assert o["logprobs"].dtype == np.float32 and o["logprobs"].shape == (len(s) - 1,)
        np.testing.assert_allclose(o["logprobs"], ref, atol=1e-5, rtol=0)
        np.testing.assert_allclose(o["elementwise_loss"], -ref * w, atol=1e-4, rtol=1e-5)
        total += float(np.sum(-ref * w))
    assert out.metrics["loss:sum"] == pytest.approx(total, rel=1e-5, abs=1e-4)


def test_base_logprobs_match_plain_hf_and_padding_is_neutral(tiny_model_dir: Path, seqs) -> None:
    from transformers import AutoModelForCausalLM

    be = backend(tiny_model_dir)
    be.create_adapter("a", LoraSpec(rank=8))
    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    batch = fb(be, "a", [datum(s) for s in seqs], forward_only=True)
    for s, o in zip(seqs, batch.outputs, strict=True):
        alone = fb(be, "a", [datum(s)], forward_only=True).outputs[0]
        assert_logprobs_close(o["logprobs"], alone["logprobs"])
        with torch.no_grad():
            lp = torch.log_softmax(hf(torch.from_numpy(s[:-1])[None]).logits[0], -1)
        np.testing.assert_allclose(
            o["logprobs"], lp[np.arange(len(s) - 1), s[1:]].numpy(), atol=1e-5
        )
    # micro-batching (forced by a tiny token budget) gives the same results
    small = backend(tiny_model_dir, max_batch_tokens=8)
    small.create_adapter("a", LoraSpec(rank=8))
    split = fb(small, "a", [datum(s) for s in seqs], forward_only=True)
    for o1, o2 in zip(batch.outputs, split.outputs, strict=True):
        assert_logprobs_close(o1["logprobs"], o2["logprobs"])


def test_top_k_targets(tiny_model_dir: Path, seqs) -> None:
    be = backend(tiny_model_dir)
    be.create_adapter("a", LoraSpec(rank=4))
    s = seqs[0]
    n = len(s) - 1
    tgt = np.stack([s[1:], (s[1:] + 7) % 2048], axis=1)
    w = np.stack([np.ones(n), np.full(n, 0.5)], axis=1).astype(np.float32)
    out = fb(be, "a", [DatumInput(s[:-1].tolist(), {"target_tokens": tgt, "weights": w})], True)
    lp0 = fb(be, "a", [datum(s)], True).outputs[0]["logprobs"]
    o = out.outputs[0]
    assert o["logprobs"].shape == (n, 2) and o["elementwise_loss"].shape == (n,)
    assert_logprobs_close(o["logprobs"][:, 0], lp0)
    np.testing.assert_allclose(o["elementwise_loss"], -(o["logprobs"] * w).sum(1), atol=1e-5)


def test_missing_weights_mean_all_ones(tiny_model_dir: Path, seqs) -> None:
    be = backend(tiny_model_dir)
    be.create_adapter("a", LoraSpec(rank=4))
    s = seqs[1]
    plain = DatumInput(s[:-1].tolist(), {"target_tokens": s[1:]})
    a = fb(be, "a", [plain], forward_only=True)
    b = fb(be, "a", [datum(s)], forward_only=True)
    assert a.metrics["loss:sum"] == b.metrics["loss:sum"]
    np.testing.assert_array_equal(a.outputs[0]["elementwise_loss"], -a.outputs[0]["logprobs"])


def _d(tokens, targets=None, weights=None, drop=()):
    n = len(tokens)
    lfi = {
        "target_tokens": np.zeros(n, np.int64) if targets is None else np.asarray(targets),
        "weights": np.ones(n, np.float32) if weights is None else np.asarray(weights),
    }
    for k in drop:
        lfi.pop(k)
    return DatumInput(tokens=tokens, loss_fn_inputs=lfi)


@pytest.mark.parametrize(
    ("data", "loss_fn", "message"),
    [
        ([], "cross_entropy", "data: must contain at least one datum"),
        (
            [_d([1, 2]), _d([])],
            "cross_entropy",
            "data[1].model_input: must contain at least one token",
        ),
        (
            [_d([1, 2048])],
            "cross_entropy",
            "data[0].model_input: token id 2048 at position 1 is out of range",
        ),
        ([_d([1, -1])], "cross_entropy", "data[0].model_input: token id -1"),
        (
            [_d([1, 2], targets=[3, 5000])],
            "cross_entropy",
            "data[0].loss_fn_inputs.target_tokens: token id 5000",
        ),
        (
            [_d([1, 2], drop=["target_tokens"])],
            "cross_entropy",
            "data[0].loss_fn_inputs.target_tokens: required",
        ),
        (
            [_d([1, 2], targets=[3])],
            "cross_entropy",
            "data[0].loss_fn_inputs.target_tokens: shape [1]",
        ),
        ([_d([1, 2], weights=[1.0])], "cross_entropy", "data[0].loss_fn_inputs.weights: shape [1]"),
        (
            [_d([1, 2], weights=[1.0, float("nan")])],
            "cross_entropy",
            "data[0].loss_fn_inputs.weights: must be finite",
        ),
        ([_d([1, 2], weights=[1.0, float("inf")])], "cross_entropy", "must be finite"),
        (
            [_d([1, 2], targets=[1.5, 2])],
            "cross_entropy",
            "data[0].loss_fn_inputs.target_tokens: must be an array of integer",
        ),
        (
            [_d([1, 2])],
            "x",
            "unknown loss_fn 'x'; known: cispo, cross_entropy, dpo, dro, gspo, "
            "importance_sampling, ppo",
        ),
        ([_d(list(range(513)))], "cross_entropy", "data[0].model_input: length 513 exceeds"),
    ],
)
def test_validation_names_the_field(tiny_model_dir: Path, data, loss_fn, message) -> None:
    be = backend(tiny_model_dir)
    be.create_adapter("a", LoraSpec(rank=4))
    with pytest.raises(UserInputError) as info:
        be.forward_backward("a", ForwardBackwardInput(data=data, loss_fn=loss_fn))
    assert message in str(info.value)
    assert all(p.grad is None for p in be._adapters["a"].params.values())
    with pytest.raises(UserInputError, match="adam_params.learning_rate"):
        be.optim_step("a", AdamParams(learning_rate=float("nan")))
