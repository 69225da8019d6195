"""Sampling backend on plain torch + HF transformers (KV-cached decoding, CPU or one GPU).

Owns its own copy of the base model with MultiLoraLinear layers, an LRU cache of adapters loaded
from checkpoint directories (PEFT files), request validation, and `sample_many`: many requests
(different tenants, adapters, prompt lengths and sampling params) decoded together in one batch by
`engine.backends.sample_decode.decode_batch` - greedy or temperature/top-k/top-p sampling from a
per-request seeded generator, stop tokens / EOS / stop strings, raw (temperature-1) token logprobs,
and prompt logprobs. `sample` is `sample_many` of one request.
"""

from __future__ import annotations

from collections.abc import Sequence
from collections.abc import Set as AbstractSet
from typing import cast

import torch

from engine.backends.adapter_cache import AdapterDirCache
from engine.backends.base import SamplingBackend, TokenListener
from engine.backends.lora import inject_multi_lora, load_adapter, remove_adapter
from engine.backends.sample_checks import validate_sample_input
from engine.backends.sample_decode import RequestState, decode_batch
from engine.backends.vision import Vision, is_vision_model, load_base_model
from engine.errors import EngineError, UserInputError
from engine.protocol import SampleInput, SampleOutput

#: the prompt_alt_tokens draws of a seeded request use this seed XOR the request seed
ALT_SEED_XOR = 0x5EED_A17


class TorchSamplingBackend(SamplingBackend):
    """Generates from the base model or from adapter checkpoint directories."""

    #: always known for this backend (the base class allows None)
    max_positions: int
    device: torch.device

    def __init__(
        self,
        model_dir: str,
        *,
        max_cached_adapters: int = 32,
        max_image_pixels: int = 4096 * 4096,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> None:
        from transformers import AutoTokenizer

        self.model = load_base_model(model_dir, dtype, device)
        self.model.requires_grad_(False)
        inject_multi_lora(self.model)
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        config = self.model.config
        #: image handling of a vision-language base model; None for a text model
        self.vision = (
            Vision(model_dir, config, max_image_pixels=max_image_pixels)
            if is_vision_model(model_dir)
            else None
        )
        text = config.get_text_config()  # a VL model's language model settings; else config
        emb = self.model.get_input_embeddings()
        # torch types Module attributes as Tensor | Module; an embedding's row count is an int
        self.vocab_size = int(cast(int, emb.num_embeddings))
        self.max_positions = int(getattr(text, "max_position_embeddings", 0) or 1 << 30)
        eos = self.tokenizer.eos_token_id
        if eos is None:
            eos = text.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
        weight = emb.weight
        assert isinstance(weight, torch.Tensor)  # the embedding matrix (a Parameter)
        self.device = weight.device
        self.max_cached_adapters = max(1, int(max_cached_adapters))
        # adapter directory → internal adapter id (engine/backends/adapter_cache.py)
        self._cache: AdapterDirCache[str] = AdapterDirCache(self.max_cached_adapters)
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
        loaded: list[str] = []

        def load(path: str) -> str:
            adapter_id = f"sampler-{self._next_id}"
            self._next_id += 1
            load_adapter(self.model, adapter_id, path)
            loaded.append(adapter_id)
            return adapter_id

        def drop_stale(stale_id: str) -> None:
            if stale_id in pinned:  # an earlier request of this batch uses the old weights
                self._retired.append(stale_id)
            else:
                remove_adapter(self.model, stale_id)

        adapter_id = self._cache.get(adapter_dir, load, drop_stale)
        if loaded:  # only a load can grow the cache past its size
            self._trim_cache(pinned | {adapter_id})
        return adapter_id

    def _trim_cache(self, pinned: AbstractSet[str] = frozenset()) -> None:
        """Evict least recently used adapters beyond the cache size, except pinned ones."""
        for stale_id in [a for a in self._retired if a not in pinned]:
            self._retired.remove(stale_id)
            remove_adapter(self.model, stale_id)
        self._cache.trim(lambda a: remove_adapter(self.model, a), keep=lambda a: a in pinned)

    def cached_adapter_dirs(self) -> list[str]:
        """Adapter directories currently loaded, least recently used first."""
        return self._cache.dirs()

    def image_token_id(self) -> int | None:
        """A VL model's image token (the one a chat template renders per image part, e.g.
        Qwen2-VL's ``<|image_pad|>``); None for a text model. The Sampler's `encode_chat_images`
        uses it; `Vision.expand` puts each image's real tokens back when sampling."""
        return None if self.vision is None else self.vision.image_token_id

    # ------------------------------------------------------------------------------- validation

    def _validate(self, inp: SampleInput) -> None:
        validate_sample_input(
            inp, vocab_size=self.vocab_size, max_positions=self.max_positions, logprob_extras=True
        )

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
        prompt, vis = [int(t) for t in inp.prompt_tokens], None
        if inp.prompt_images:
            if self.vision is None:
                raise UserInputError(
                    "prompt.chunks: image chunks: this base model is text-only; images need a VL "
                    "model"
                )
            prompt, vis = self.vision.expand(prompt, inp.prompt_images, "prompt")
            if len(prompt) + p.max_tokens > self.max_positions:
                raise UserInputError(
                    f"prompt: {len(prompt)} tokens with its images + max_tokens {p.max_tokens} "
                    f"exceed the model's maximum sequence length {self.max_positions}"
                )
        return RequestState(
            inp=inp,
            adapter=adapter,
            prompt=prompt,
            vision=vis,
            stop_ids=stop_ids,
            generator=None if p.temperature == 0 else self._make_generator(p.seed),
            alt_gen=alt_gen,
        )

    @torch.no_grad()
    def sample_many(
        self,
        inputs: Sequence[SampleInput],
        listeners: Sequence[TokenListener | None] | None = None,
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
                vision=self.vision,
            )
        finally:
            self._trim_cache()
        for i, r in ready:
            results[i] = r.output()
        return results  # type: ignore[return-value]

    def adapter_cache_stats(self) -> dict[str, int]:
        return self._cache.stats()

    def sample(self, inp: SampleInput) -> SampleOutput:
        """Generate ``inp.num_samples`` sequences for one prompt (raises its EngineError)."""
        out = self.sample_many([inp])[0]
        if isinstance(out, EngineError):
            raise out
        return out
