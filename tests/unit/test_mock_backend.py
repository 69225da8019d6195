"""The mock backend pair (engine/backends/mock.py): deterministic, full-contract, torch-free, and
enough for the Trainer and the Sampler to run end to end (routing tests use it)."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from engine.backends.mock import MOCK_EMBEDDING_LOSSES, MOCK_LOSSES, MockTrainingBackend
from engine.backends.mock_sampling import MockSamplingBackend
from engine.errors import AdapterNotFoundError, CheckpointError, UserInputError
from engine.protocol import (
    AdamParams,
    DatumInput,
    ForwardBackwardInput,
    LoraSpec,
    SampleInput,
    SamplingParams,
)

MOCK = {"name": "twinkle/tiny-chat", "backend": "mock", "sampler_type": "mock"}


def _inp(seed: int = 0, n: int = 3, forward_only: bool = False) -> ForwardBackwardInput:
    rng = np.random.default_rng(seed)
    data = []
    for _ in range(n):
        toks = rng.integers(0, 500, 12)
        w = rng.random(12).astype(np.float32)
        data.append(DatumInput(toks.tolist(), {"target_tokens": np.roll(toks, -1), "weights": w}))
    return ForwardBackwardInput(data, forward_only=forward_only)


def _train(be: MockTrainingBackend, aid: str = "a", steps: int = 2) -> list:
    be.create_adapter(aid, LoraSpec(rank=8, seed=3))
    seen = []
    for s in range(steps):
        out = be.forward_backward(aid, _inp(s))
        seen += [out.metrics, [o["logprobs"].tolist() for o in out.outputs]]
        seen.append(be.optim_step(aid, AdamParams(learning_rate=0.1)).metrics)
    return seen


def test_training_is_deterministic_and_learns() -> None:
    first, second = _train(MockTrainingBackend()), _train(MockTrainingBackend())
    assert first == second
    be = MockTrainingBackend()
    _train(be, steps=5)
    before = be.forward_backward("a", _inp(0, forward_only=True)).metrics["loss:sum"]
    be2 = MockTrainingBackend()
    be2.create_adapter("a", LoraSpec(rank=8, seed=3))
    fresh = be2.forward_backward("a", _inp(0, forward_only=True)).metrics["loss:sum"]
    assert before < fresh  # AdamW on the weighted-logprob loss lowers it


def test_gradients_accumulate_and_forward_only_adds_none() -> None:
    be = MockTrainingBackend()
    be.create_adapter("a", LoraSpec(rank=4))
    out = be.forward_backward("a", _inp(1, forward_only=True))
    assert not be.has_pending_grad("a") and be.adapter_grad("a", "norm") == 0.0
    assert set(out.outputs[0]) == {"logprobs", "elementwise_loss"}
    assert out.metrics["loss:sum"] == pytest.approx(
        sum(float(o["elementwise_loss"].sum()) for o in out.outputs), rel=1e-5
    )
    be.forward_backward("a", _inp(1))
    one = be.adapter_grad("a", "norm")
    be.forward_backward("a", _inp(1))
    assert be.adapter_grad("a", "norm") == pytest.approx(2 * one)
    assert be.optim_step("a", AdamParams()).metrics["grad_norm"] == pytest.approx(2 * one)
    with pytest.raises(UserInputError, match="no gradient"):
        be.optim_step("a", AdamParams())


def test_rejected_input_changes_nothing() -> None:
    be = MockTrainingBackend()
    be.create_adapter("a", LoraSpec(rank=4))
    bad = _inp(0)
    bad.data[-1].tokens = [1, 99999]
    bad.data[-1].loss_fn_inputs["target_tokens"] = np.array([1, 2])
    for call in (be.validate_input, lambda i: be.forward_backward("a", i)):
        with pytest.raises(UserInputError, match=r"data\[2\]\.tokens"):
            call(bad)
    assert not be.has_pending_grad("a")
    with pytest.raises(UserInputError, match="loss_fn"):
        be.validate_input(ForwardBackwardInput(_inp().data, loss_fn="nope"))
    with pytest.raises(AdapterNotFoundError):
        be.forward_backward("missing", _inp())
    with pytest.raises(UserInputError, match="rank"):
        be.create_adapter("b", LoraSpec(rank=3))


def test_mock_knows_the_real_losses() -> None:
    from engine.backends.losses import EMBEDDING_LOSSES, KNOWN_LOSSES

    assert tuple(sorted(MOCK_LOSSES)) == tuple(KNOWN_LOSSES)
    assert tuple(sorted(MOCK_EMBEDDING_LOSSES)) == tuple(EMBEDDING_LOSSES)


def test_checkpoints_are_real_files_and_round_trip(tmp_path: Path) -> None:
    be = MockTrainingBackend()
    _train(be)
    be.forward_backward("a", _inp(7))  # a pending gradient is not saved
    size = be.save_state("a", str(tmp_path / "ck"), include_optimizer=True)
    files = sorted(p.name for p in (tmp_path / "ck").iterdir())
    assert "adapter_model.safetensors" in files and "manifest.json" in files
    assert size == sum((tmp_path / "ck" / f).stat().st_size for f in files)
    with pytest.raises(CheckpointError, match="exists"):
        be.save_state("a", str(tmp_path / "ck"), include_optimizer=False)
    be.optim_step("a", AdamParams(learning_rate=0.1))  # continue from the pending gradient
    other = MockTrainingBackend()
    assert other.load_state("x", str(tmp_path / "ck"), include_optimizer=True).seed == 3
    assert not other.has_pending_grad("x")
    fwd = _inp(0, forward_only=True)
    other.forward_backward("x", _inp(7))
    other.optim_step("x", AdamParams(learning_rate=0.1))  # same state, same step: same weights
    a = be.forward_backward("a", fwd).outputs[0]["logprobs"]
    assert np.array_equal(other.forward_backward("x", fwd).outputs[0]["logprobs"], a)
    be.save_state("a", str(tmp_path / "weights"), include_optimizer=False)
    with pytest.raises(CheckpointError, match="no optimizer state"):
        other.load_state("y", str(tmp_path / "weights"), include_optimizer=True)
    with pytest.raises(CheckpointError, match="not found"):
        other.load_state("y", str(tmp_path / "nope"), include_optimizer=False)
    assert not other.has_adapter("y")


def test_sampling_is_deterministic_and_follows_the_adapter(tmp_path: Path) -> None:
    be = MockTrainingBackend()
    _train(be)
    be.save_state("a", str(tmp_path / "a"), include_optimizer=False)
    sa, sb = MockSamplingBackend(), MockSamplingBackend()
    req = SampleInput([1, 2, 3], num_samples=3, params=SamplingParams(max_tokens=6))
    base = sa.sample(req)
    assert base == sb.sample(req)
    assert len({tuple(s.tokens) for s in base.sequences}) == 3  # temperature 1: rows differ
    greedy = sa.sample(SampleInput([1, 2, 3], 3, SamplingParams(max_tokens=6, temperature=0)))
    assert len({tuple(s.tokens) for s in greedy.sequences}) == 1
    tuned = SampleInput([1, 2, 3], 3, SamplingParams(max_tokens=6), adapter_dir=str(tmp_path / "a"))
    old = sa.sample(tuned)
    assert old == sb.sample(tuned) != base
    assert all(
        32 <= t < 127 and s.stop_reason == "length" for s in base.sequences for t in s.tokens
    )
    # a directory rewritten in place is read afresh (the cache is keyed by the file's stat)
    be.forward_backward("a", _inp(9))
    be.optim_step("a", AdamParams(learning_rate=0.5))
    be.save_state("a", str(tmp_path / "a2"), include_optimizer=False)
    weights = "adapter_model.safetensors"
    os.replace(tmp_path / "a2" / weights, tmp_path / "a" / weights)
    assert sa.sample(tuned) != old
    assert sa.cached_adapter_dirs() == [os.path.realpath(tmp_path / "a")]


def test_sample_many_streams_stops_and_isolates_errors(tmp_path: Path) -> None:
    sa = MockSamplingBackend()
    first = sa.sample(SampleInput([5], params=SamplingParams(max_tokens=8, seed=1)))
    stop_at = first.sequences[0].tokens[2]
    got: list = []
    reqs = [
        SampleInput([5], params=SamplingParams(max_tokens=8, seed=1, stop_token_ids=[stop_at])),
        SampleInput([5], adapter_dir=str(tmp_path / "missing")),
        SampleInput([9999]),
    ]
    out = sa.sample_many(reqs, [lambda s, t, lp: got.append((s, t)), None, None])
    seq = out[0].sequences[0]
    assert seq.stop_reason == "stop" and seq.tokens == first.sequences[0].tokens[:3]
    assert got == [(0, t) for t in seq.tokens]
    assert isinstance(out[1], CheckpointError) and isinstance(out[2], UserInputError)
    lps = sa.sample(SampleInput([4, 5, 6], prompt_logprobs=True)).prompt_logprobs
    assert np.isnan(lps[0]) and len(lps) == 3 and all(v < 0 for v in lps[1:])


def test_tokenizer_stand_in() -> None:
    tok = MockSamplingBackend().tokenizer
    ids = tok.encode("héllo")
    assert tok.decode(ids) == "héllo" and tok.decode(ids + [tok.eos_token_id]) == "héllo</s>"
    assert tok.decode(ids + [tok.eos_token_id], skip_special_tokens=True) == "héllo"
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert text == "<|user|>hi\n<|assistant|>"


def test_trainer_and_sampler_end_to_end_without_torch(tmp_path: Path) -> None:
    """In a fresh interpreter: build a Trainer and a Sampler from config names, create, train,
    save, sample; torch and transformers are never imported."""
    code = f"""
import asyncio, sys
import numpy as np
from engine.trainer import Trainer
from engine.sampler import Sampler
from engine.protocol import *
cfg = dict({MOCK!r}, max_loaded_adapters=1)
tr, sa = Trainer(cfg, {str(tmp_path)!r}), Sampler(cfg, {str(tmp_path)!r})
toks = [1, 2, 3, 4, 5, 6]
inp = ForwardBackwardInput([DatumInput(toks, {{"target_tokens": np.array(toks[1:] + [7])}})])
async def main():
    await tr.create_adapter("m1", LoraSpec(rank=8))
    await tr.create_adapter("m2", LoraSpec(rank=8))  # capacity 1: m1 is offloaded
    out = await tr.forward_backward("m1", 1, inp)
    assert out.metrics["loss:sum"] > 0 and len(out.outputs[0]["logprobs"]) == 6
    assert await tr.adapter_grad("m1", 2, "norm") > 0
    step = await tr.optim_step("m1", 3, AdamParams(learning_rate=0.1))
    assert step.metrics["step"] == 1.0
    assert await tr.save_state("m1", 4, {str(tmp_path / "ck")!r}, False) > 0
    res = await sa.sample(SampleInput([1, 2], 2, adapter_dir={str(tmp_path / "ck")!r}))
    assert len(res.sequences) == 2
    assert (await tr.stats())["pool"]["reloads"] >= 1
    print(await tr.info())
asyncio.run(main())
sa.close()
print(sorted(m for m in ("torch", "transformers", "vllm") if m in sys.modules))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    info, loaded = out.stdout.strip().splitlines()[-2:]
    assert "'vocab_size': 512" in info and loaded == "[]"


def test_determinism_across_processes(tmp_path: Path) -> None:
    """Checkpoint bytes and sampled tokens do not depend on the process (no hash randomisation,
    no clock): same operations, same files, same tokens."""
    code = """
import sys, numpy as np
from engine.backends.mock import MockTrainingBackend
from engine.backends.mock_sampling import MockSamplingBackend
from engine.protocol import AdamParams, DatumInput, ForwardBackwardInput, LoraSpec, SampleInput
be = MockTrainingBackend()
be.create_adapter("a", LoraSpec(rank=8, seed=3))
toks = [3, 1, 4, 1, 5, 9]
datum = DatumInput(toks, {"target_tokens": np.array(toks)})
be.forward_backward("a", ForwardBackwardInput([datum]))
be.optim_step("a", AdamParams(learning_rate=0.1))
be.save_state("a", sys.argv[1], include_optimizer=True)
print(MockSamplingBackend().sample(SampleInput([1, 2], 2, adapter_dir=sys.argv[1])).sequences)
"""
    runs = []
    for i in range(2):
        d = tmp_path / f"ck{i}"
        out = subprocess.run([sys.executable, "-c", code, str(d)], capture_output=True, text=True)
        assert out.returncode == 0, out.stderr[-3000:]
        weights = hashlib.sha256((d / "adapter_model.safetensors").read_bytes()).hexdigest()
        runs.append((weights, out.stdout))
    assert runs[0] == runs[1]
