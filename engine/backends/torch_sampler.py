"""Sampling backend on plain torch + HF transformers (KV-cached decoding, CPU or one GPU).

Owns its own copy of the base model with MultiLoraLinear layers, an LRU cache of adapters loaded
from checkpoint directories (PEFT files), request validation, and `sample_many`: many requests
(different tenants, adapters, prompt lengths and sampling params) decoded together in one batch by
`engine.backends.sampler_decode.decode_batch` - greedy or temperature/top-k/top-p sampling from a
per-request seeded generator, stop tokens / EOS / stop strings, raw (temperature-1) token logprobs,
and prompt logprobs. `sample` is `sample_many` of one request.
"""

from __future__ import annotations

import math
import numbers
import os
from collections import OrderedDict
from collections.abc import Callable, Sequence
from collections.abc import Set as AbstractSet
from pathlib import Path

import numpy as np
import torch

from engine.backends.base import SamplingBackend
from engine.backends.lora import (
    ADAPTER_WEIGHTS_NAME,
    inject_multi_lora,
    load_adapter,
    remove_adapter,
)
from engine.backends.sampler_decode import RequestState, decode_batch
from engine.backends.sampler_decode import filter_logits as _filter_logits  # noqa: F401 (tests)
from engine.errors import CheckpointError, EngineError, UserInputError
from engine.protocol import SampleInput, SampleOutput, SamplingParams


#: widest top-k logprobs matrix per position we return (Tinker bounds it too; 20 is OpenAI's);
#: also the bound of prompt_alt_tokens_k
MAX_TOPK = 20
#: token ids scored per prompt position with target_prompt_logprobs
MAX_TARGET_IDS = 64
ALT_SEED_XOR = 0x5EED_A17


def _is_int(v) -> bool:
    # numpy integers count (numbers.Integral); bools do not
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


class TorchSamplingBackend(SamplingBackend):
    """Generates from the base model or from adapter checkpoint directories."""

    def __init__(self, model_dir: str, *, max_cached_adapters: int = 32) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        self.model.eval()
        self.model.requires_grad_(False)
        inject_multi_lora(self.model)
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        config = self.model.config
        self.vocab_size = int(self.model.get_input_embeddings().num_embeddings)
        self.max_positions = int(getattr(config, "max_position_embeddings", 0) or 1 << 30)
        eos = self.tokenizer.eos_token_id
        if eos is None:
            eos = config.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
        self.device = self.model.get_input_embeddings().weight.device
        self.max_cached_adapters = max(1, int(max_cached_adapters))
        # (realpath, mtime_ns, size) of adapter_model.safetensors → internal adapter id; the stat
        # parts make a directory rewritten in place load afresh instead of serving stale weights.
        self._cache: OrderedDict[tuple[str, int, int], str] = OrderedDict()
        self._next_id = 0
        self._retired: list[str] = []  # replaced in place while pinned; unloaded after the batch
        pad = self.tokenizer.pad_token_id
        self.pad_id = int(pad if pad is not None else next(iter(self.eos_ids), 0))

    # ------------------------------------------------------------------------------- adapters

    def _adapter_id(self, adapter_dir: str, pinned: set[str] | None = None) -> str:
        """Internal id of the adapter in ``adapter_dir``, loading it if needed. Ids in ``pinned``
        (used by the batch being assembled) are never evicted or unloaded here: the cache may
        then exceed its size until `_trim_cache` runs after the batch."""
        pinned = pinned if pinned is not None else set()
        path = os.path.realpath(adapter_dir)
        try:
            st = (Path(path) / ADAPTER_WEIGHTS_NAME).stat()
        except OSError:
            raise CheckpointError(f"adapter checkpoint {adapter_dir} not found") from None
        key = (path, st.st_mtime_ns, st.st_size)
        if key in self._cache:
            self._cache.move_to_end(key)
            return self._cache[key]
        for stale in [k for k in self._cache if k[0] == path]:
            stale_id = self._cache.pop(stale)
            if stale_id in pinned:  # an earlier request of this batch uses the old weights
                self._retired.append(stale_id)
            else:
                remove_adapter(self.model, stale_id)
        adapter_id = f"sampler-{self._next_id}"
        self._next_id += 1
        load_adapter(self.model, adapter_id, path)
        self._cache[key] = adapter_id
        self._trim_cache(pinned | {adapter_id})
        return adapter_id

    def _trim_cache(self, pinned: AbstractSet[str] = frozenset()) -> None:
        """Evict least recently used adapters beyond the cache size, except pinned ones."""
        for stale_id in [a for a in self._retired if a not in pinned]:
            self._retired.remove(stale_id)
            remove_adapter(self.model, stale_id)
        excess = len(self._cache) - self.max_cached_adapters
        for key in list(self._cache):
            if excess <= 0:
                break
            if self._cache[key] not in pinned:
                remove_adapter(self.model, self._cache.pop(key))
                excess -= 1

    def cached_adapter_dirs(self) -> list[str]:
        """Adapter directories currently loaded, least recently used first."""
        return [k[0] for k in self._cache]

    # ------------------------------------------------------------------------------- validation

    def _validate(self, inp: SampleInput) -> None:
        p: SamplingParams = inp.params
        prompt = inp.prompt_tokens
        if not prompt:
            raise UserInputError("prompt: must contain at least one token")
        for j, t in enumerate(prompt):
            if not _is_int(t) or not 0 <= t < self.vocab_size:
                raise UserInputError(
                    f"prompt: token id {t!r} at position {j} is out of range [0, {self.vocab_size}) (the vocab size)"
                )
        if not _is_int(inp.num_samples) or inp.num_samples < 1:
            raise UserInputError(f"num_samples: {inp.num_samples!r} must be an integer >= 1")
        if not _is_int(p.max_tokens) or p.max_tokens < 1:
            raise UserInputError(
                f"sampling_params.max_tokens: {p.max_tokens!r} must be an integer >= 1"
            )
        if len(prompt) + p.max_tokens > self.max_positions:
            raise UserInputError(
                f"sampling_params.max_tokens: prompt length {len(prompt)} + max_tokens "
                f"{p.max_tokens} "
                f"exceeds the model's maximum sequence length {self.max_positions}"
            )
        if (
            not (isinstance(p.temperature, (int, float)) and math.isfinite(p.temperature))
            or p.temperature < 0
        ):
            raise UserInputError(f"sampling_params.temperature: {p.temperature!r} must be >= 0")
        if not _is_int(p.top_k) or p.top_k < -1:
            raise UserInputError(f"sampling_params.top_k: {p.top_k!r} must be -1 (off) or >= 1")
        if not (isinstance(p.top_p, (int, float)) and 0 < p.top_p <= 1):
            raise UserInputError(f"sampling_params.top_p: {p.top_p!r} must be in (0, 1]")
        if p.seed is not None and not _is_int(p.seed):
            raise UserInputError(f"sampling_params.seed: {p.seed!r} must be an integer")
        for t in p.stop_token_ids:
            if not _is_int(t) or t < 0:
                raise UserInputError(
                    f"sampling_params.stop: token id {t!r} must be an integer >= 0"
                )
        if any(not isinstance(s, str) or not s for s in p.stop_strings):
            raise UserInputError("sampling_params.stop: stop strings must be non-empty strings")
        for name in ("topk_prompt_logprobs", "topk_sample_logprobs"):
            k = getattr(inp, name)
            if not _is_int(k) or not 0 <= k <= MAX_TOPK:
                raise UserInputError(f"{name}: {k!r} must be an integer in [0, {MAX_TOPK}]")
        if inp.topk_prompt_logprobs and not inp.prompt_logprobs:
            raise UserInputError("topk_prompt_logprobs: needs include_prompt_logprobs (prompt_logprobs)")
        k = inp.prompt_alt_tokens_k
        if not _is_int(k) or not 0 <= k <= MAX_TOPK:
            raise UserInputError(f"prompt_alt_tokens_k: {k!r} must be an integer in [0, {MAX_TOPK}]")
        if k and len(prompt) < 2:
            raise UserInputError("prompt_alt_tokens_k: needs a prompt of at least 2 tokens")
        if inp.target_prompt_ids is not None:
            self._validate_targets(np.asarray(inp.target_prompt_ids), len(prompt))
        n = inp.prompt_logprobs_last_n
        if n is not None:
            if not inp.prompt_logprobs:
                raise UserInputError(
                    "prompt_logprobs_last_n: applies to prompt logprobs; set prompt_logprobs"
                )
            if not _is_int(n) or not 1 <= n <= len(prompt) - 1:
                raise UserInputError(
                    f"prompt_logprobs_last_n: {n!r} must be between 1 and len(prompt) - 1 = "
                    f"{len(prompt) - 1}"
                )

    def _validate_targets(self, ids: np.ndarray, prompt_len: int) -> None:
        rows = prompt_len - 1
        if ids.ndim != 2 or ids.shape[0] != rows or not 1 <= ids.shape[1] <= MAX_TARGET_IDS:
            raise UserInputError(
                f"target_prompt_logprobs: shape {list(ids.shape)} must be [len(prompt) - 1 = "
                f"{rows}, K] with 1 <= K <= {MAX_TARGET_IDS}"
            )
        if not np.issubdtype(ids.dtype, np.integer):
            raise UserInputError("target_prompt_logprobs: must hold int64 token ids")
        if ((ids < -1) | (ids >= self.vocab_size)).any():
            raise UserInputError(
                f"target_prompt_logprobs: token ids must be -1 (none) or in [0, {self.vocab_size})"
            )
        if not (ids >= 0).any():
            raise UserInputError("target_prompt_logprobs: must name at least one token id")

    # ------------------------------------------------------------------------------- decoding

    def _make_generator(self, seed: int | None) -> torch.Generator:
        gen = torch.Generator(device=self.device)
        if seed is None:
            gen.seed()  # nondeterministic, and leaves the global RNG alone
        else:
            gen.manual_seed(int(seed) % (1 << 64))
        return gen

    def _hits_stop_string(self, tokens: list[int], stops: list[str], window: int) -> bool:
        # Every token decodes to at least one byte, so a stop string of b bytes that ends in the
        # newest token lies within the last b + 1 tokens (the +1 covers a split UTF-8 character).
        text = self.tokenizer.decode(
            tokens[-window:], skip_special_tokens=False, clean_up_tokenization_spaces=False
        )
        return any(s in text for s in stops)

    def _prepare(self, inp: SampleInput, pinned: set[str]) -> RequestState:
        self._validate(inp)
        p = inp.params
        adapter = self._adapter_id(inp.adapter_dir, pinned) if inp.adapter_dir else None
        if adapter is not None:
            pinned.add(adapter)
        stop_ids = {int(t) for t in p.stop_token_ids} | (self.eos_ids if p.stop_at_eos else set())
        alt_gen = None
        if inp.prompt_alt_tokens_k and p.temperature != 0:
            # a seeded request's alternatives reproduce too, from a stream of their own
            alt_gen = self._make_generator(None if p.seed is None else int(p.seed) ^ ALT_SEED_XOR)
        return RequestState(
            inp=inp,
            adapter=adapter,
            prompt=[int(t) for t in inp.prompt_tokens],
            stop_ids=stop_ids,
            generator=None if p.temperature == 0 else self._make_generator(p.seed),
            alt_gen=alt_gen,
        )

    @torch.no_grad()
    def sample_many(
        self,
        inputs: Sequence[SampleInput],
        listeners: Sequence[Callable[[int, int, float], None] | None] | None = None,
    ) -> list[SampleOutput | EngineError]:
        """Decode all ``inputs`` (any adapters, prompt lengths and params) in one batch.

        ``listeners[i]``, when given, is called with (sample index, token, logprob) for each token
        of input i as soon as it is generated (streaming).

        Slot i gets input i's output, or the EngineError that input alone raised (validation,
        a missing or bad checkpoint); a failing input does not stop the others. Every output
        equals what `sample` of that input alone gives (see sampler_decode). Unexpected backend
        failures raise.
        """
        results: list[SampleOutput | EngineError | None] = [None] * len(inputs)
        ready: list[tuple[int, RequestState]] = []
        pinned: set[str] = set()
        try:
            for i, inp in enumerate(inputs):
                try:
                    state = self._prepare(inp, pinned)
                    state.listener = listeners[i] if listeners is not None else None
                    ready.append((i, state))
                except EngineError as e:
                    results[i] = e
            # adapter order (base rows first, then adapters in order of first appearance), then
            # input order: each adapter's rows form one contiguous routing segment
            first: dict[str | None, int] = {None: -1}
            for _, r in ready:
                first.setdefault(r.adapter, len(first))
            ready.sort(key=lambda t: (first[t[1].adapter], t[0]))
            decode_batch(
                self.model,
                [r for _, r in ready],
                pad_id=self.pad_id,
                device=self.device,
                hits_stop=self._hits_stop_string,
            )
        finally:
            self._trim_cache()
        for i, r in ready:
            results[i] = r.output()
        return results  # type: ignore[return-value]

    def sample(self, inp: SampleInput) -> SampleOutput:
        """Generate ``inp.num_samples`` sequences for one prompt (raises its EngineError)."""
        out = self.sample_many([inp])[0]
        if isinstance(out, EngineError):
            raise out
        return out
