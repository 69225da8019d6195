"""TorchSamplingBackend: greedy == HF generate (base and peft-loaded adapters), seeded sampling,
stop handling, adapter LRU cache, validation, `sample` is `sample_many` of one request (logprobs:
test_torch_sampler_logprobs.py; batched sampling itself: test_batched_sampling.py)."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from engine.backends.sample_decode import filter_logits
from engine.backends.sample_torch import TorchSamplingBackend
from engine.errors import CheckpointError, UserInputError
from engine.protocol import (
    SampleInput,
    SamplingParams,
)
from tests import factories
from tests.factories import random_adapter
from tests.unit.torch_sampler_helpers import (
    CHATS,
    _hf,
    _hf_greedy,
    _peft,
    _prompt,
    _sample,
)


@pytest.fixture(scope="module")
def sampler(tiny_model_dir: Path) -> TorchSamplingBackend:
    return TorchSamplingBackend(str(tiny_model_dir))


@pytest.fixture(scope="module")
def trained_adapter(tiny_model_dir: Path, tmp_path_factory, sampler) -> Path:
    """A checkpoint from the training backend, trained on a few chat lines."""
    ids = [sampler.tokenizer(text)["input_ids"] for text in CHATS]
    out = tmp_path_factory.mktemp("ckpt") / "trained"
    return factories.trained_adapter(tiny_model_dir, ids, out, 60)


@pytest.fixture(scope="module")
def perturbed_adapter(tiny_model_dir: Path, tmp_path_factory) -> Path:
    return random_adapter(tiny_model_dir, tmp_path_factory.mktemp("ckpt") / "perturbed", seed=5)


@pytest.mark.parametrize("which", ["base", "trained", "perturbed"])
def test_greedy_equals_hf_generate(which, request, tiny_model_dir, sampler) -> None:
    adapter = None if which == "base" else request.getfixturevalue(f"{which}_adapter")
    reference = _hf(tiny_model_dir) if adapter is None else _peft(tiny_model_dir, adapter)
    eos = sampler.tokenizer.eos_token_id
    prompts = [
        _prompt(sampler),
        _prompt(sampler, "User: describe Alice's pet. Assistant:"),
        sampler.tokenizer.apply_chat_template(
            [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
        ),
    ]
    distinct = set()
    for p in prompts:
        p = sampler.tokenizer(p)["input_ids"] if isinstance(p, str) else p
        expected = _hf_greedy(reference, p, 24)
        if eos in expected:  # HF stops at EOS too (and pads after it)
            expected = expected[: expected.index(eos) + 1]
        seq = _sample(sampler, p, adapter, max_tokens=24, temperature=0.0).sequences[0]
        assert seq.tokens == expected
        assert seq.stop_reason == (
            "stop" if expected[-1] == eos and len(expected) <= 24 else "length"
        )
        distinct |= set(seq.tokens)
    if which != "base":
        assert len(distinct) > 5  # the adapter makes the output non-trivial


def test_trained_adapter_learned_its_data(sampler, trained_adapter) -> None:
    seq = _sample(
        sampler, _prompt(sampler), trained_adapter, max_tokens=4, temperature=0.0
    ).sequences[0]
    assert sampler.tokenizer.decode(seq.tokens).startswith(" 25.")


def test_seeded_sampling_reproduces(sampler, perturbed_adapter) -> None:
    prompt = _prompt(sampler)
    kw = {"n": 3, "max_tokens": 16, "temperature": 1.0, "stop_at_eos": False}
    a = _sample(sampler, prompt, perturbed_adapter, seed=42, **kw)
    b = _sample(sampler, prompt, perturbed_adapter, seed=42, **kw)
    c = _sample(sampler, prompt, perturbed_adapter, seed=43, **kw)
    assert [s.tokens for s in a.sequences] == [s.tokens for s in b.sequences]
    assert [s.logprobs for s in a.sequences] == [s.logprobs for s in b.sequences]
    assert [s.tokens for s in a.sequences] != [s.tokens for s in c.sequences]
    assert len({tuple(s.tokens) for s in a.sequences}) > 1
    unseeded = [
        _sample(sampler, prompt, perturbed_adapter, **kw).sequences[0].tokens for _ in range(2)
    ]
    assert unseeded[0] != unseeded[1]
    greedy = (
        _sample(sampler, prompt, perturbed_adapter, max_tokens=16, temperature=0.0)
        .sequences[0]
        .tokens
    )
    for extra in ({"top_k": 1}, {"top_p": 1e-6}):
        got = _sample(
            sampler, prompt, perturbed_adapter, max_tokens=16, temperature=1.5, seed=1, **extra
        )
        assert got.sequences[0].tokens == greedy


def testfilter_logits() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.05, 0.15, 0.3, 0.5]]))

    def keep(x):
        return torch.isfinite(x).tolist()

    assert keep(filter_logits(logits, 3, 1.0)) == [
        [True, True, True, False],
        [False, True, True, True],
    ]
    assert keep(filter_logits(logits, -1, 0.75)) == [
        [True, True, False, False],
        [False, False, True, True],
    ]
    assert keep(filter_logits(logits, -1, 0.4)) == [
        [True, False, False, False],
        [False, False, False, True],
    ]
    assert keep(filter_logits(logits, 2, 0.95)) == [
        [True, True, False, False],
        [False, False, True, True],
    ]
    torch.testing.assert_close(filter_logits(logits, -1, 1.0), logits)


def test_stop_strings_and_stop_tokens_cut_exactly(sampler, perturbed_adapter) -> None:
    prompt = _prompt(sampler)
    full = _sample(
        sampler, prompt, perturbed_adapter, max_tokens=30, temperature=0.0, stop_at_eos=False
    )
    tokens = full.sequences[0].tokens

    def dec(t):
        return sampler.tokenizer.decode(t, skip_special_tokens=False)

    text = dec(tokens)
    assert len(tokens) == 30 and full.sequences[0].stop_reason == "length"
    b5, b12 = len(dec(tokens[:5])), len(dec(tokens[:12]))
    # inside the text, spanning token boundaries (several tokens for the second), one char, the end
    for lo, hi in ((b5 - 2, b5 + 2), (b12 - 3, b12 + 9), (10, 11), (len(text) - 3, len(text))):
        stop = text[lo:hi]
        cut = next(j for j in range(1, 31) if stop in dec(tokens[:j]))
        seq = _sample(
            sampler,
            prompt,
            perturbed_adapter,
            max_tokens=30,
            temperature=0.0,
            stop_strings=[stop, "\x00never"],
        ).sequences[0]
        assert seq.tokens == tokens[:cut] and seq.stop_reason == "stop", (stop, cut)
        assert len(seq.logprobs) == cut
    idx = 6
    first = tokens.index(tokens[idx])
    seq = _sample(
        sampler,
        prompt,
        perturbed_adapter,
        max_tokens=30,
        temperature=0.0,
        stop_token_ids=[tokens[idx]],
    ).sequences[0]
    assert seq.tokens == tokens[: first + 1] and seq.stop_reason == "stop"
    # EOS: honoured only when stop_at_eos
    old = sampler.eos_ids
    sampler.eos_ids = {tokens[idx]}
    try:
        assert (
            _sample(sampler, prompt, perturbed_adapter, max_tokens=30, temperature=0.0)
            .sequences[0]
            .tokens
            == tokens[: first + 1]
        )
        assert (
            _sample(
                sampler,
                prompt,
                perturbed_adapter,
                max_tokens=30,
                temperature=0.0,
                stop_at_eos=False,
            )
            .sequences[0]
            .tokens
            == tokens
        )
    finally:
        sampler.eos_ids = old


def test_finished_rows_stop_growing(sampler, perturbed_adapter) -> None:
    out = _sample(
        sampler,
        _prompt(sampler),
        perturbed_adapter,
        n=6,
        max_tokens=20,
        temperature=1.0,
        seed=3,
        stop_strings=["e"],
    )
    lengths = set()
    for seq in out.sequences:
        text = sampler.tokenizer.decode(seq.tokens)
        if seq.stop_reason == "stop":
            assert "e" in text and "e" not in sampler.tokenizer.decode(seq.tokens[:-1])
        else:
            assert len(seq.tokens) == 20 and "e" not in text
        assert len(seq.logprobs) == len(seq.tokens)
        lengths.add(len(seq.tokens))
    assert len(lengths) > 1


def test_adapter_cache_lru_and_reload(
    tiny_model_dir, sampler, perturbed_adapter, trained_adapter, tmp_path
) -> None:
    prompt = _prompt(sampler)
    expect = {
        d: _sample(sampler, prompt, d, max_tokens=8, temperature=0.0).sequences[0].tokens
        for d in (perturbed_adapter, trained_adapter, None)
    }
    small = TorchSamplingBackend(str(tiny_model_dir), max_cached_adapters=1)
    for d in (perturbed_adapter, trained_adapter, perturbed_adapter, None, trained_adapter):
        assert (
            _sample(small, prompt, d, max_tokens=8, temperature=0.0).sequences[0].tokens
            == expect[d]
        )
    assert small.cached_adapter_dirs() == [str(trained_adapter.resolve())]
    # a directory rewritten in place is reloaded, not served from the cache
    moving = tmp_path / "moving"
    shutil.copytree(perturbed_adapter, moving)
    first = _sample(small, prompt, moving, max_tokens=8, temperature=0.0).sequences[0].tokens
    shutil.rmtree(moving)
    random_adapter(tiny_model_dir, moving, seed=6)
    second = _sample(small, prompt, moving, max_tokens=8, temperature=0.0).sequences[0].tokens
    assert first == expect[perturbed_adapter] and second != first
    with pytest.raises(CheckpointError):
        _sample(small, prompt, tmp_path / "missing", max_tokens=2)


@pytest.mark.parametrize(
    ("prompt", "n", "params", "extra", "message"),
    [
        ([], 1, {}, {}, "prompt: must contain at least one token"),
        ([1, 2048], 1, {}, {}, "prompt: token id 2048 at position 1"),
        ([1, -3], 1, {}, {}, "prompt: token id -3"),
        ([1], 0, {}, {}, "num_samples"),
        ([1], 1, {"max_tokens": 0}, {}, "sampling_params.max_tokens"),
        ([1] * 500, 1, {"max_tokens": 13}, {}, "exceeds the model's maximum sequence length 512"),
        ([1], 1, {"temperature": -0.1}, {}, "sampling_params.temperature"),
        ([1], 1, {"top_p": 0.0}, {}, "sampling_params.top_p"),
        ([1], 1, {"top_k": -2}, {}, "sampling_params.top_k"),
        ([1], 1, {"stop_strings": [""]}, {}, "sampling_params.stop"),
        ([1, 2], 1, {}, {"topk_prompt_logprobs": 3}, "topk_prompt_logprobs: needs"),
        ([1, 2], 1, {}, {"topk_sample_logprobs": 21}, r"topk_sample_logprobs: 21 .*\[0, 20\]"),
        ([1, 2], 1, {}, {"prompt_logprobs_last_n": 1}, "prompt_logprobs_last_n: applies"),
        (
            [1, 2],
            1,
            {},
            {"prompt_logprobs": True, "prompt_logprobs_last_n": 2},
            r"prompt_logprobs_last_n: 2 must be between 1 and len\(prompt\) - 1 = 1",
        ),
    ],
)
def test_validation_names_the_field(sampler, prompt, n, params, extra, message) -> None:
    inp = SampleInput(prompt_tokens=prompt, num_samples=n, params=SamplingParams(**params), **extra)
    with pytest.raises(UserInputError, match=message):
        sampler.sample(inp)


def test_sample_is_sample_many_of_one(sampler, perturbed_adapter) -> None:
    inp = SampleInput(
        prompt_tokens=_prompt(sampler),
        num_samples=2,
        params=SamplingParams(max_tokens=8, temperature=0.9, seed=4),
        prompt_logprobs=True,
        adapter_dir=str(perturbed_adapter),
    )
    one = sampler.sample(inp)
    (many,) = sampler.sample_many([inp])
    assert [s.tokens for s in one.sequences] == [s.tokens for s in many.sequences]
    assert [s.logprobs for s in one.sequences] == [s.logprobs for s in many.sequences]
    np.testing.assert_array_equal(one.prompt_logprobs, many.prompt_logprobs)
    bad = SampleInput(prompt_tokens=[1], params=SamplingParams(top_p=0.0))
    (err,) = sampler.sample_many([bad])
    assert isinstance(err, UserInputError)
    with pytest.raises(UserInputError, match="top_p"):
        sampler.sample(bad)
