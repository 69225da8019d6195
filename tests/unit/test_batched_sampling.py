"""Batched sampling: `TorchSamplingBackend.sample_many` (many tenants/adapters in one decode loop)
equals sampling each request alone; per-request errors, prompt logprobs, adapter-cache pinning;
the Sampler service coalesces concurrent requests into batches."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from engine.backends.lora import (
    lora_layers,
)
from engine.backends.sample_decode import adapter_segments
from engine.backends.sample_torch import TorchSamplingBackend
from engine.errors import CheckpointError, EngineError, UserInputError
from engine.protocol import (
    LoraSpec,
    SampleInput,
    SampleOutput,
    SamplingParams,
)
from engine.sampler import Sampler
from tests.factories import random_adapter, trained_adapter

TEXTS = [
    "User: what is 12 plus 13? Assistant:",
    "User: describe Alice's pet. Assistant:",
    "User: hi",
    "User: what is the capital of France? Assistant: The capital",
    "Alice",
    "User: tell me a long story about a red cat that likes to sleep in the sun. Assistant:",
]


@pytest.fixture(scope="module")
def sampler(tiny_model_dir: Path) -> TorchSamplingBackend:
    return TorchSamplingBackend(str(tiny_model_dir))


@pytest.fixture(scope="module")
def adapters(tiny_model_dir: Path, tmp_path_factory, sampler) -> list[Path]:
    """Four checkpoints: one trained by the training backend, three perturbed with different
    ranks and target sets."""
    root = tmp_path_factory.mktemp("batched-ckpt")
    chats = ("User: what is 12 plus 13? Assistant: 25.", "User: hi Assistant: hello!")
    ids = [sampler.tokenizer(text)["input_ids"] for text in chats]
    trained = trained_adapter(tiny_model_dir, ids, root / "trained", 30)
    specs = [
        LoraSpec(rank=4, alpha=8.0, seed=5),
        LoraSpec(rank=2, alpha=4.0, seed=6, train_mlp=False),
        LoraSpec(rank=16, alpha=16.0, seed=7, train_attn=False, train_unembed=False),
    ]
    return [trained] + [
        random_adapter(tiny_model_dir, root / f"perturbed-{i}", 10 + i, spec)
        for i, spec in enumerate(specs)
    ]


def _inp(sampler, text_or_ids, adapter=None, n=1, prompt_logprobs=False, **params) -> SampleInput:
    prompt = (
        sampler.tokenizer(text_or_ids)["input_ids"] if isinstance(text_or_ids, str) else text_or_ids
    )
    return SampleInput(
        prompt_tokens=prompt,
        num_samples=n,
        params=SamplingParams(**params),
        prompt_logprobs=prompt_logprobs,
        adapter_dir=str(adapter) if adapter else None,
    )


def _assert_same(batched: SampleOutput, alone: SampleOutput, *, check_logprobs=True) -> None:
    assert len(batched.sequences) == len(alone.sequences)
    for b, a in zip(batched.sequences, alone.sequences, strict=True):
        assert b.tokens == a.tokens
        assert b.stop_reason == a.stop_reason
        assert len(b.logprobs) == len(b.tokens)
        if check_logprobs:
            np.testing.assert_allclose(b.logprobs, a.logprobs, atol=1e-5, rtol=0)
    if alone.prompt_logprobs is None:
        assert batched.prompt_logprobs is None
    else:
        np.testing.assert_allclose(
            batched.prompt_logprobs, alone.prompt_logprobs, atol=1e-5, rtol=0
        )  # NaN at 0 in both (assert_allclose treats NaN == NaN)


def _greedy_requests(sampler, adapters) -> list[SampleInput]:
    """16 greedy requests: 3 per adapter + 4 base, prompts of different lengths, interleaved
    adapters, some with several samples, different max_tokens, one with a stop string."""
    owners = [None] + list(adapters)
    reqs = []
    for k in range(16):
        owner = owners[k % 5] if k < 15 else None
        reqs.append(
            _inp(
                sampler,
                TEXTS[k % len(TEXTS)],
                owner,
                n=1 + (k % 3 == 0),
                max_tokens=24 - (k % 4) * 5,
                temperature=0.0,
                stop_strings=["Paris"] if k == 7 else [],
            )
        )
    return reqs


def test_16_greedy_requests_over_4_adapters_equal_one_by_one(sampler, adapters) -> None:
    reqs = _greedy_requests(sampler, adapters)
    assert len({r.adapter_dir for r in reqs}) == 5 and len({len(r.prompt_tokens) for r in reqs}) > 4
    alone = [sampler.sample(r) for r in reqs]
    batched = sampler.sample_many(reqs)
    for b, a in zip(batched, alone, strict=True):
        _assert_same(b, a)
    # the adapters really differ from the base and from each other
    same_prompt = [
        _inp(sampler, TEXTS[0], a, max_tokens=12, temperature=0.0) for a in [None, *adapters]
    ]
    assert len({tuple(o.sequences[0].tokens) for o in sampler.sample_many(same_prompt)}) == 5
    # and a different composition (reversed, duplicated) gives the same again
    again = sampler.sample_many(list(reversed(reqs)) + reqs[:3])
    for b, a in zip(again[:16], reversed(alone), strict=True):
        _assert_same(b, a)
    for b, a in zip(again[16:], alone[:3], strict=True):
        _assert_same(b, a)


def test_seeded_sampling_is_independent_of_the_batch(sampler, adapters) -> None:
    owners = [None] + list(adapters)
    reqs = [
        _inp(
            sampler,
            TEXTS[k % len(TEXTS)],
            owners[k % 5],
            n=1 + k % 3,
            max_tokens=16,
            temperature=(0.7, 1.0, 1.3)[k % 3],
            top_k=(-1, 50, 8)[k % 3],
            top_p=(1.0, 0.9, 0.95)[k % 3],
            seed=100 + k,
            stop_strings=["e"] if k % 4 == 1 else [],
        )
        for k in range(12)
    ]
    alone = [sampler.sample(r) for r in reqs]
    mixed = reqs + [_inp(sampler, TEXTS[0], adapters[0], max_tokens=8, temperature=0.0)]
    for b, a in zip(sampler.sample_many(mixed)[:-1], alone, strict=True):
        _assert_same(b, a)
    for b, a in zip(sampler.sample_many(reqs[::-1]), alone[::-1], strict=True):
        _assert_same(b, a)
    assert any(len({tuple(s.tokens) for s in a.sequences}) > 1 for a in alone)


def test_errors_stay_in_their_slot_and_prompt_logprobs_per_request(
    sampler, adapters, tmp_path
) -> None:
    good = [
        _inp(sampler, TEXTS[0], adapters[1], max_tokens=6, temperature=0.0, prompt_logprobs=True),
        _inp(sampler, TEXTS[1], None, n=2, max_tokens=5, temperature=0.0),
        _inp(sampler, TEXTS[3], adapters[2], max_tokens=7, temperature=0.0, prompt_logprobs=True),
        _inp(sampler, [5], adapters[0], max_tokens=3, temperature=0.0, prompt_logprobs=True),
    ]
    bad = [
        _inp(sampler, [1, 99999], max_tokens=4),
        _inp(sampler, TEXTS[0], tmp_path / "missing", max_tokens=4),
        _inp(sampler, TEXTS[0], max_tokens=0),
    ]
    mixed = [bad[0], good[0], bad[1], good[1], good[2], bad[2], good[3]]
    out = sampler.sample_many(mixed)
    assert isinstance(out[0], UserInputError) and "position 1" in str(out[0])
    assert isinstance(out[2], CheckpointError)
    assert isinstance(out[5], UserInputError) and "max_tokens" in str(out[5])
    for b, inp in zip([out[1], out[3], out[4], out[6]], good, strict=True):
        a = sampler.sample(inp)
        _assert_same(b, a)
        if inp.prompt_logprobs:
            assert len(b.prompt_logprobs) == len(inp.prompt_tokens)
            assert np.isnan(b.prompt_logprobs[0]) and np.isfinite(b.prompt_logprobs[1:]).all()
        else:
            assert b.prompt_logprobs is None
    assert all(isinstance(r, EngineError) for r in sampler.sample_many(bad))
    assert sampler.sample_many([]) == []


def test_more_adapters_than_the_cache_holds(tiny_model_dir, sampler, adapters) -> None:
    reqs = [
        _inp(sampler, TEXTS[k], a, max_tokens=6, temperature=0.0) for k, a in enumerate(adapters)
    ]
    expect = sampler.sample_many(reqs)
    small = TorchSamplingBackend(str(tiny_model_dir), max_cached_adapters=1)
    got = small.sample_many(reqs + reqs[:1])
    for b, a in zip(got, expect + expect[:1], strict=True):
        _assert_same(b, a)
    assert small.cached_adapter_dirs() == [str(adapters[0].resolve())]  # used last
    loaded = {aid for layer in lora_layers(small.model) for aid in layer.adapters}
    assert len(loaded) == 1  # the others were unloaded after the batch


def test_adapter_segments() -> None:
    assert adapter_segments([None, None, "a", "a", "b", None, "b"]) == [
        ("a", 2, 4),
        ("b", 4, 5),
        ("b", 6, 7),
    ]
    assert adapter_segments([]) == [] and adapter_segments([None]) == []


# ----------------------------------------------------------------------------------- Sampler


class _GatedBackend:
    """Wraps a real backend; the first batch waits on ``gate`` so later requests queue up."""

    def __init__(self, inner: TorchSamplingBackend) -> None:
        self.inner = inner
        self.vocab_size = inner.vocab_size
        self.gate = threading.Event()
        self.batches: list[int] = []

    def sample(self, inp):
        return self.inner.sample(inp)

    def sample_many(self, inputs):
        self.gate.wait(timeout=30)
        self.batches.append(len(inputs))
        return self.inner.sample_many(inputs)


def _service(backend, **kw) -> Sampler:
    return Sampler({"name": "twinkle/tiny-chat"}, "/nonexistent", backend=backend, **kw)


async def _queue_then_open(svc: Sampler, gated: _GatedBackend, reqs):
    first = asyncio.ensure_future(svc.sample(reqs[0]))
    await asyncio.sleep(0.05)  # the worker has taken the first request and waits at the gate
    rest = [asyncio.ensure_future(svc.sample(r)) for r in reqs[1:]]
    await asyncio.sleep(0.05)
    gated.gate.set()
    return await asyncio.gather(first, *rest, return_exceptions=True)


def test_sampler_batches_concurrent_requests(sampler, adapters) -> None:
    reqs = _greedy_requests(sampler, adapters)[:9]
    reqs.insert(4, _inp(sampler, [1, 99999], max_tokens=4))  # one bad request among them
    gated = _GatedBackend(sampler)
    svc = _service(gated, max_batch_rows=8)
    try:
        results = asyncio.run(_queue_then_open(svc, gated, reqs))
        stats = asyncio.run(svc.stats())
        info = asyncio.run(svc.info())
    finally:
        svc.close()
    assert isinstance(results[4], UserInputError)
    for res, inp in zip(results, reqs, strict=True):
        if inp is not reqs[4]:
            _assert_same(res, sampler.sample(inp))
    # rows 2 | 1,1,2,1,1,1 | 2,1,1: the first waits alone at the gate, then batches of <= 8 rows
    assert [r.num_samples for r in reqs] == [2, 1, 1, 2, 1, 1, 1, 2, 1, 1]
    assert gated.batches == [1, 6, 3]
    assert stats["batches"] == 3 and stats["requests"] == 10 and stats["rows"] == 13
    assert stats["mean_batch_rows"] == pytest.approx(13 / 3) and stats["max_batch_rows_seen"] == 7
    assert info == {"base_model": "twinkle/tiny-chat", "vocab_size": sampler.vocab_size}


def test_sampler_isolates_an_unexpected_batch_failure(sampler) -> None:
    class Flaky:
        vocab_size = sampler.vocab_size

        def sample_many(self, inputs):
            raise RuntimeError("boom")

        def sample(self, inp):
            if inp.params.max_tokens == 3:
                raise RuntimeError("bad one")
            return sampler.sample(inp)

    svc = _service(Flaky())
    ok = _inp(sampler, TEXTS[0], max_tokens=4, temperature=0.0)
    bad = _inp(sampler, TEXTS[0], max_tokens=3, temperature=0.0)

    async def go():
        return await asyncio.gather(svc.sample(ok), svc.sample(bad), return_exceptions=True)

    try:
        res = asyncio.run(go())
    finally:
        svc.close()
    assert isinstance(res[1], RuntimeError)
    _assert_same(res[0], sampler.sample(ok))


def test_sampler_default_backend_path_and_close(tiny_model_dir, sampler) -> None:
    svc = Sampler(
        {"name": "twinkle/tiny-chat", "path": str(tiny_model_dir)}, str(tiny_model_dir.parent)
    )
    inp = _inp(sampler, TEXTS[2], max_tokens=5, temperature=0.0)

    async def go():
        return await asyncio.gather(*(svc.sample(inp) for _ in range(4)))

    t0 = time.monotonic()
    outs = asyncio.run(go())
    assert time.monotonic() - t0 < 60
    for o in outs:
        _assert_same(o, sampler.sample(inp))
    stats = asyncio.run(svc.stats())
    assert stats["requests"] == 4 and 1 <= stats["batches"] <= 4
    svc.close()
    svc.close()
    with pytest.raises(RuntimeError, match="closed"):
        asyncio.run(svc.sample(inp))


def test_sampler_builds_its_backend_on_the_worker_thread(tiny_model_dir, tmp_path) -> None:
    from engine.errors import ConfigError

    with pytest.raises(ConfigError, match="does not exist"):
        Sampler({"name": "x/y", "path": str(tmp_path / "nope")}, str(tmp_path))
    svc = Sampler({"name": "x/y", "path": str(tiny_model_dir)}, str(tmp_path))
    try:
        assert isinstance(svc.backend, TorchSamplingBackend)
        assert asyncio.run(svc.info())["vocab_size"] == svc.backend.vocab_size
    finally:
        svc.close()


def test_sample_stream_yields_tokens_as_generated_and_equals_sample(sampler, adapters) -> None:
    """Streaming: several deltas arrive before the end, their tokens are a prefix of the final
    output, and the final output equals `sample` of the same request (here batched together with
    a non-streaming request on another adapter)."""
    reqs = _greedy_requests(sampler, adapters)
    streamed, other = reqs[1], reqs[2]
    seeded = SampleInput(
        prompt_tokens=list(streamed.prompt_tokens),
        num_samples=2,
        params=SamplingParams(max_tokens=24, temperature=0.9, seed=7, stop_at_eos=False),
        adapter_dir=streamed.adapter_dir,
    )
    svc = _service(sampler)

    async def main():
        deltas = []

        async def consume():
            async for d in svc.sample_stream(seeded):
                deltas.append((time.perf_counter(), d))

        t_other = asyncio.ensure_future(svc.sample(other))
        await consume()
        return deltas, await t_other

    try:
        deltas, other_out = asyncio.run(main())
    finally:
        svc.close()
    *partial, last = deltas
    assert last[1].final is not None and not last[1].tokens
    assert len(partial) >= 2, "tokens must arrive before the request finishes"
    final = last[1].final
    _assert_same(final, sampler.sample(seeded))
    _assert_same(other_out, sampler.sample(other))
    for s in range(2):
        got = [t for _, d in partial for t in d.tokens.get(s, [])]
        lps = [v for _, d in partial for v in d.logprobs.get(s, [])]
        assert got == list(final.sequences[s].tokens)[: len(got)]
        assert lps == pytest.approx(list(final.sequences[s].logprobs)[: len(lps)])
