"""The ``mock`` sampling backend: hash-derived tokens, torch-free. FOR ROUTING TESTS ONLY.

Config ``sampler_type: mock`` (engine/backends/registry.py); the training half and the toy model
are in engine/backends/mock.py. Sampling is a hash of (adapter weights file contents, prompt,
seed, sample index, position): printable ASCII token ids, so the byte-level `MockTokenizer`
decodes them to text.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from pathlib import Path

from engine.backends.adapter_cache import WEIGHTS_FILE, AdapterDirCache
from engine.backends.base import SamplingBackend, TokenListener
from engine.backends.mock import EOS_ID, VOCAB_SIZE
from engine.backends.sample_checks import validate_sample_input
from engine.errors import EngineError
from engine.protocol import SampledSequence, SampleInput, SampleOutput


class MockTokenizer:
    """Byte-level stand-in for a Hugging Face tokenizer: id < 256 is that byte, `EOS_ID` is
    ``</s>``; the chat template writes ``<|role|>content\\n`` per message."""

    eos_token, eos_token_id, pad_token_id = "</s>", EOS_ID, EOS_ID
    chat_template = "mock"

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids, skip_special_tokens: bool = False, **_: object) -> str:
        raw = bytearray()
        for t in ids:
            if 0 <= int(t) < 256:
                raw.append(int(t))
            elif int(t) == EOS_ID and not skip_special_tokens:
                raw.extend(self.eos_token.encode())
        return raw.decode("utf-8", errors="replace")

    def apply_chat_template(
        self, messages, add_generation_prompt: bool = True, tokenize: bool = True, **_: object
    ):
        text = "".join(f"<|{m['role']}|>{m.get('content') or ''}\n" for m in messages)
        text += "<|assistant|>" if add_generation_prompt else ""
        return self.encode(text) if tokenize else text


def _hash(*parts: object) -> int:
    return int.from_bytes(hashlib.sha256(repr(parts).encode()).digest()[:8], "little")


class MockSamplingBackend(SamplingBackend):
    """Hash-derived tokens from the prompt and the adapter's weights file. Routing tests only.

    Same inputs, same tokens, with or without a seed (temperature 0: every sample is the same).
    A sequence ends at a stop token, a stop string, or ``max_tokens``; it never emits EOS.
    """

    #: always known for this backend (the base class allows None)
    max_positions: int

    def __init__(
        self,
        *,
        vocab_size: int = VOCAB_SIZE,
        max_positions: int | None = None,
        max_cached_adapters: int = 32,
    ) -> None:
        self.vocab_size = int(vocab_size)
        self.max_positions = int(max_positions) if max_positions else 2048
        self.tokenizer = MockTokenizer()
        # adapter directory → sha256 of its weights file (rewritten in place: hashed afresh)
        self._cache: AdapterDirCache[str] = AdapterDirCache(max_cached_adapters)

    def _fingerprint(self, adapter_dir: str | None) -> str:
        if adapter_dir is None:
            return "base"

        def load(path: str) -> str:
            return hashlib.sha256((Path(path) / WEIGHTS_FILE).read_bytes()).hexdigest()

        fp = self._cache.get(adapter_dir, load, lambda _: None)
        self._cache.trim(lambda _: None)
        return fp

    def cached_adapter_dirs(self) -> list[str]:
        return self._cache.dirs()

    def _sample(self, inp: SampleInput, listener: TokenListener | None) -> SampleOutput:
        validate_sample_input(inp, vocab_size=self.vocab_size, max_positions=self.max_positions)
        p, prompt = inp.params, tuple(int(t) for t in inp.prompt_tokens)
        fp = self._fingerprint(inp.adapter_dir)
        stops = {int(t) for t in p.stop_token_ids}
        seqs = []
        for s in range(inp.num_samples):
            row = 0 if p.temperature == 0 else s  # greedy: every row is the same
            tokens: list[int] = []
            lps: list[float] = []
            reason = "length"
            for j in range(p.max_tokens):
                h = _hash(fp, prompt, p.seed, row, j)
                tok, lp = 32 + h % 95, -1.0 - (h >> 16) % 1000 / 1000.0  # printable ASCII
                tokens.append(tok)
                lps.append(lp)
                if listener is not None:
                    listener(s, tok, lp)
                text = self.tokenizer.decode(tokens)
                if tok in stops or any(x in text for x in p.stop_strings):
                    reason = "stop"
                    break
            seqs.append(SampledSequence(tokens, lps, reason))
        prompt_lps = None
        if inp.prompt_logprobs:
            prompt_lps = [math.nan] + [
                -1.0 - _hash(fp, prompt[: j + 1]) % 1000 / 1000.0 for j in range(1, len(prompt))
            ]
        return SampleOutput(sequences=seqs, prompt_logprobs=prompt_lps)

    def sample(self, inp: SampleInput) -> SampleOutput:
        return self._sample(inp, None)

    def sample_many(
        self,
        inputs: Sequence[SampleInput],
        listeners: Sequence[TokenListener | None] | None = None,
    ) -> list[SampleOutput | EngineError]:
        results: list[SampleOutput | EngineError] = []
        for i, inp in enumerate(inputs):
            try:
                results.append(self._sample(inp, listeners[i] if listeners else None))
            except EngineError as e:
                results.append(e)
        return results
