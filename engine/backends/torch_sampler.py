"""Sampling backend on plain torch + HF transformers (KV-cached decoding, CPU or one GPU).

Owns its own copy of the base model with MultiLoraLinear layers, an LRU cache of adapters loaded
from checkpoint directories (PEFT files), request validation, and the decoding loop: greedy or
temperature/top-k/top-p sampling from a seeded generator, stop tokens / EOS / stop strings, raw
(temperature-1) token logprobs, and prompt logprobs.
"""

from __future__ import annotations

import math
import numbers
import os
from collections import OrderedDict
from pathlib import Path

import torch

from engine.backends.base import SamplingBackend
from engine.backends.lora import (
    ADAPTER_WEIGHTS_NAME,
    inject_multi_lora,
    load_adapter,
    lora_routing,
    remove_adapter,
)
from engine.errors import CheckpointError, UserInputError
from engine.protocol import SampledSequence, SampleInput, SampleOutput, SamplingParams


def _is_int(v) -> bool:
    # numpy integers count (numbers.Integral); bools do not
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def _filter_logits(x: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Mask (to -inf) everything outside the top-k and outside the top-p nucleus, per row."""
    if 0 < top_k < x.shape[-1]:
        kth = torch.topk(x, top_k, dim=-1).values[:, -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if top_p < 1.0:
        sorted_x, order = torch.sort(x, dim=-1, descending=True)
        probs = torch.softmax(sorted_x, dim=-1)
        # keep the smallest prefix whose mass reaches top_p: drop a token when the mass before it
        # already does (the most likely token is always kept)
        drop = (torch.cumsum(probs, dim=-1) - probs) >= top_p
        drop[:, 0] = False
        sorted_x = sorted_x.masked_fill(drop, float("-inf"))
        x = torch.full_like(x, float("-inf")).scatter(-1, order, sorted_x)
    return x


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

    # ------------------------------------------------------------------------------- adapters

    def _adapter_id(self, adapter_dir: str) -> str:
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
            remove_adapter(self.model, self._cache.pop(stale))
        adapter_id = f"sampler-{self._next_id}"
        self._next_id += 1
        load_adapter(self.model, adapter_id, path)
        self._cache[key] = adapter_id
        while len(self._cache) > self.max_cached_adapters:
            _, evicted = self._cache.popitem(last=False)
            remove_adapter(self.model, evicted)
        return adapter_id

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
        if inp.topk_prompt_logprobs:
            raise UserInputError("topk_prompt_logprobs: not supported by this sampler; use 0")

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

    @torch.no_grad()
    def sample(self, inp: SampleInput) -> SampleOutput:
        self._validate(inp)
        p = inp.params
        n = inp.num_samples
        adapter = self._adapter_id(inp.adapter_dir) if inp.adapter_dir else None

        def route(rows: int):
            return lora_routing(self.model, [(adapter, 0, rows)] if adapter else [])

        prompt_ids = [int(t) for t in inp.prompt_tokens]
        prompt = torch.tensor([prompt_ids], dtype=torch.long, device=self.device)
        with route(1):  # the prompt runs once; its KV cache is then copied to the n rows
            out = self.model(
                input_ids=prompt, use_cache=True, logits_to_keep=0 if inp.prompt_logprobs else 1
            )
        prompt_lps = None
        if inp.prompt_logprobs:
            lp = torch.log_softmax(out.logits[0, :-1].float(), dim=-1)
            picked = lp.gather(-1, prompt[0, 1:, None])[:, 0]
            prompt_lps = [math.nan] + [float(v) for v in picked.cpu()]
        cache = out.cache
        logits = out.logits[:, -1, :].float()
        if n > 1:
            cache.batch_repeat_interleave(n)
            logits = logits.expand(n, -1)

        gen = self._make_generator(p.seed)
        stop_ids = {int(t) for t in p.stop_token_ids} | (self.eos_ids if p.stop_at_eos else set())
        stops = list(p.stop_strings)
        window = max((len(s.encode("utf-8")) for s in stops), default=0) + 1
        tokens: list[list[int]] = [[] for _ in range(n)]
        logprobs: list[list[float]] = [[] for _ in range(n)]
        reasons = ["length"] * n
        active = list(range(n))  # original row of each row still in the batch
        for step in range(p.max_tokens):
            raw_lp = torch.log_softmax(logits, dim=-1)
            if p.temperature == 0:
                nxt = torch.argmax(logits, dim=-1)
            else:
                x = _filter_logits(logits / p.temperature, p.top_k, p.top_p)
                nxt = torch.multinomial(torch.softmax(x, dim=-1), 1, generator=gen)[:, 0]
            chosen = raw_lp.gather(-1, nxt[:, None])[:, 0]
            keep: list[int] = []
            for j, (tok, lpv) in enumerate(zip(nxt.tolist(), chosen.tolist(), strict=True)):
                row = active[j]
                tokens[row].append(tok)
                logprobs[row].append(lpv)
                if tok in stop_ids or (
                    stops and self._hits_stop_string(tokens[row], stops, window)
                ):
                    reasons[row] = "stop"  # a finished row stops growing
                else:
                    keep.append(j)
            if not keep or step == p.max_tokens - 1:
                break
            if len(keep) < len(active):  # drop finished rows from the batch and the cache
                idx = torch.tensor(keep, dtype=torch.long, device=self.device)
                cache.batch_select_indices(idx)
                nxt = nxt[idx]
                active = [active[j] for j in keep]
            with route(len(active)):
                out = self.model(input_ids=nxt[:, None], cache=cache, use_cache=True)
            cache = out.cache
            logits = out.logits[:, -1, :].float()
        return SampleOutput(
            sequences=[SampledSequence(tokens[r], logprobs[r], reasons[r]) for r in range(n)],
            prompt_logprobs=prompt_lps,
        )
