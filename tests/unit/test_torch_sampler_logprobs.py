"""TorchSamplingBackend logprobs against a forward pass: sampled tokens, top-k alternatives, and
prompt logprobs of target tokens."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from engine.backends.sample_torch import TorchSamplingBackend
from engine.errors import UserInputError
from engine.protocol import (
    SampleInput,
    SamplingParams,
)
from tests.factories import random_adapter
from tests.unit.torch_sampler_helpers import (
    _peft,
    _prompt,
    _sample,
)


@pytest.fixture(scope="module")
def sampler(tiny_model_dir: Path) -> TorchSamplingBackend:
    return TorchSamplingBackend(str(tiny_model_dir))


@pytest.fixture(scope="module")
def perturbed_adapter(tiny_model_dir: Path, tmp_path_factory) -> Path:
    return random_adapter(tiny_model_dir, tmp_path_factory.mktemp("ckpt") / "perturbed", seed=5)


def test_logprobs_match_forward_pass(tiny_model_dir, sampler, perturbed_adapter) -> None:
    prompt = _prompt(sampler)
    out = _sample(
        sampler,
        prompt,
        perturbed_adapter,
        n=2,
        prompt_logprobs=True,
        max_tokens=12,
        temperature=0.7,
        top_k=50,
        seed=11,
    )
    ref = _peft(tiny_model_dir, perturbed_adapter)
    for seq in out.sequences:
        full = prompt + seq.tokens
        with torch.no_grad():
            lp = torch.log_softmax(ref(torch.tensor([full])).logits[0].double(), -1)
        expected = lp[torch.arange(len(full) - 1), torch.tensor(full[1:])].numpy()
        np.testing.assert_allclose(seq.logprobs, expected[len(prompt) - 1 :], atol=1e-5, rtol=0)
        assert len(seq.logprobs) == len(seq.tokens) == 12 and seq.stop_reason == "length"
    pl = out.prompt_logprobs
    assert len(pl) == len(prompt) and math.isnan(pl[0])
    np.testing.assert_allclose(pl[1:], expected[: len(prompt) - 1], atol=1e-5, rtol=0)
    assert _sample(sampler, prompt[:1], prompt_logprobs=True, max_tokens=1).prompt_logprobs[0] != 0
    assert _sample(sampler, prompt, max_tokens=1).prompt_logprobs is None


def test_topk_logprobs_match_forward_pass(tiny_model_dir, sampler, perturbed_adapter) -> None:
    """Top-k prompt and sampled logprobs equal torch.topk of a float64 forward pass (1e-5), with
    Tinker's layout: len(prompt) prompt rows, row 0 empty (0, -99999); prompt_logprobs_last_n
    leaves earlier positions unscored; batching with other requests changes nothing."""
    prompt = _prompt(sampler)
    k, ks, last_n = 4, 3, 5
    inp = SampleInput(
        prompt_tokens=prompt,
        num_samples=2,
        params=SamplingParams(max_tokens=10, temperature=0.8, seed=5),
        prompt_logprobs=True,
        topk_prompt_logprobs=k,
        topk_sample_logprobs=ks,
        prompt_logprobs_last_n=last_n,
        adapter_dir=str(perturbed_adapter),
    )
    out = sampler.sample(inp)
    ref = _peft(tiny_model_dir, perturbed_adapter)
    n = len(prompt)
    for seq in out.sequences:
        full = prompt + seq.tokens
        with torch.no_grad():
            lp = torch.log_softmax(ref(torch.tensor([full])).logits[0].double(), -1)
        top = lp.topk(k, dim=-1)
        # prompt rows: position i is predicted by row i - 1 of the forward pass
        tp = out.topk_prompt
        assert tp.token_ids.shape == (n, k) and tp.token_ids.dtype == np.int32
        unscored = n - last_n
        assert (tp.token_ids[:unscored] == 0).all() and (tp.logprobs[:unscored] == -99999.0).all()
        np.testing.assert_array_equal(tp.token_ids[unscored:], top.indices[unscored - 1 : n - 1])
        np.testing.assert_allclose(
            tp.logprobs[unscored:], top.values[unscored - 1 : n - 1], atol=1e-5, rtol=0
        )
        pl = out.prompt_logprobs
        assert all(math.isnan(v) for v in pl[:unscored]) and not any(map(math.isnan, pl[unscored:]))
        # sampled rows: token j is predicted by row n - 1 + j
        st = seq.topk
        assert st.token_ids.shape == (len(seq.tokens), ks)
        rows = slice(n - 1, n - 1 + len(seq.tokens))
        np.testing.assert_array_equal(st.token_ids, top.indices[rows, :ks])
        np.testing.assert_allclose(st.logprobs, top.values[rows, :ks], atol=1e-5, rtol=0)
        assert (np.diff(st.logprobs, axis=1) <= 0).all()
    other = SampleInput(prompt_tokens=prompt[:4], params=SamplingParams(max_tokens=3))
    batched, plain = sampler.sample_many([inp, other])
    for a, b in zip(batched.sequences, out.sequences, strict=True):
        assert a.tokens == b.tokens
        np.testing.assert_array_equal(a.topk.token_ids, b.topk.token_ids)
    assert plain.topk_prompt is None and plain.sequences[0].topk is None


def test_alt_tokens_and_target_prompt_logprobs(tiny_model_dir, sampler, perturbed_adapter) -> None:
    """target_prompt_logprobs: the named ids' logprobs at each prompt position (0.0 for -1);
    prompt_alt_tokens_k: draws from the next-token distribution with their logprobs; seeded
    draws reproduce, and asking for them does not change the sampled sequences."""
    prompt = _prompt(sampler)
    n = len(prompt)
    rng = np.random.default_rng(0)
    ids = rng.integers(0, sampler.vocab_size, size=(n - 1, 3))
    ids[::2, 1] = -1
    base = {
        "prompt_tokens": prompt,
        "params": SamplingParams(max_tokens=6, temperature=0.9, seed=3),
        "adapter_dir": str(perturbed_adapter),
    }
    out = sampler.sample(SampleInput(**base, target_prompt_ids=ids, prompt_alt_tokens_k=4))
    ref = _peft(tiny_model_dir, perturbed_adapter)
    with torch.no_grad():
        lp = torch.log_softmax(ref(torch.tensor([prompt])).logits[0].double(), -1)[: n - 1]
    expected = lp.gather(-1, torch.tensor(ids).clamp(min=0)).numpy()
    expected[ids < 0] = 0.0
    assert out.target_prompt_logprobs.shape == (n - 1, 3)
    np.testing.assert_allclose(out.target_prompt_logprobs, expected, atol=1e-5, rtol=0)
    toks, lps = out.prompt_alt_tokens
    assert toks.shape == lps.shape == (n - 1, 4) and toks.dtype == np.int64
    np.testing.assert_allclose(lps, lp.gather(-1, torch.tensor(toks)).numpy(), atol=1e-5, rtol=0)
    again = sampler.sample(SampleInput(**base, target_prompt_ids=ids, prompt_alt_tokens_k=4))
    np.testing.assert_array_equal(again.prompt_alt_tokens[0], toks)
    plain = sampler.sample(SampleInput(**base))
    assert [s.tokens for s in plain.sequences] == [s.tokens for s in out.sequences]
    assert plain.prompt_alt_tokens is None and plain.target_prompt_logprobs is None
    greedy = sampler.sample(
        SampleInput(
            prompt_tokens=prompt,
            params=SamplingParams(max_tokens=1, temperature=0),
            prompt_alt_tokens_k=2,
        )
    )
    with torch.no_grad():
        base_lp = sampler.model(torch.tensor([prompt])).logits[0, : n - 1]
    np.testing.assert_array_equal(greedy.prompt_alt_tokens[0][:, 0], base_lp.argmax(-1).numpy())
    for bad, msg in [
        (ids[:-1], r"target_prompt_logprobs: shape \[.*\] must be \[len\(prompt\) - 1"),
        (np.full((n - 1, 2), -1), "at least one token id"),
        (np.full((n - 1, 1), 99999), "token ids must be -1"),
    ]:
        with pytest.raises(UserInputError, match=msg):
            sampler.sample(SampleInput(prompt_tokens=prompt, target_prompt_ids=bad))
