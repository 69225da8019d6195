"""Sampling backend on vLLM (``sampler_type: vllm``; GPU, or `vllm-cpu` in a separate venv).

Owns one ``vllm.LLM`` engine for a base model, the mapping of adapter checkpoint directories (PEFT
files) to vLLM ``LoRARequest``s with stable integer ids, and the translation between our protocol
(`SampleInput` / `SampleOutput`, engine/protocol.py) and vLLM's ``SamplingParams`` /
``RequestOutput``. `sample_many` sends every request (any adapters) to one ``LLM.generate`` call,
whose scheduler batches them (continuous batching, multi-LoRA kernels); `sample` is `sample_many`
of one request. Results follow the torch sampler's format and semantics:

* temperature 0 is greedy; vLLM refuses ``n > 1`` with greedy, and greedy rows are identical
  anyway, so one row is generated and copied;
* per-token logprobs are vLLM's raw logprobs (before temperature / top-k / top-p), as the torch
  sampler returns; prompt logprobs have NaN at position 0;
* stop strings are matched on text decoded with special tokens kept, the stop text stays in the
  output; EOS stops a row unless ``stop_at_eos`` is False (then only the explicit stop ids do);
* bad input is a `UserInputError` naming the field (engine/backends/sample_checks.py); an adapter
  vLLM cannot load (missing files, rank above the engine's ``max_lora_rank``, a target module this
  model's vLLM implementation has no LoRA support for, e.g. ``lm_head`` of Qwen2) is a
  `CheckpointError` for that request only, found before the batch runs.

CPU workaround (vllm-cpu 0.32): its LoRA torch ops index the adapter slots with the row's slot
number, and base-model rows carry -1, i.e. the *last* slot: once every slot has held an adapter,
base rows silently get that adapter's output (the GPU Triton kernels skip -1). On the CPU platform
base-model requests therefore run through an all-zero rank-1 adapter (written at start-up), so no
row ever carries -1.

Adapter cache (engine/backends/adapter_cache.py): ``(realpath, mtime_ns, size)`` of
``adapter_model.safetensors`` → a LoRARequest with a fresh int id (a directory rewritten in place
gets a new id, so vLLM never serves stale weights).
Every LoRARequest carries its path, so when vLLM has evicted the adapter from its own CPU cache
(``max_cpu_loras``) it reloads it from disk: a cache miss is never an error.

``vllm`` is imported lazily in the constructor: the engine package imports this module's name only
when a model is configured with ``sampler_type: vllm``, and the main venv does not have vllm
(hence ``# pyright: ignore[reportMissingImports]`` on each vllm import).
"""

from __future__ import annotations

import contextlib
import json
import math
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from engine.backends.adapter_cache import AdapterDirCache
from engine.backends.base import SamplingBackend, TokenListener
from engine.backends.peft_files import ADAPTER_WEIGHTS_NAME, read_adapter_config
from engine.backends.sample_checks import validate_sample_input
from engine.errors import (
    BackendError,
    CheckpointError,
    ConfigError,
    EngineError,
    UserInputError,
)
from engine.protocol import SampledSequence, SampleInput, SampleOutput

#: ranks vLLM accepts for ``max_lora_rank`` (vllm/config/lora.py, MaxLoRARanks)
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def vllm_lora_rank(max_lora_rank: int) -> int:
    """The smallest rank vLLM accepts that holds adapters of rank up to ``max_lora_rank``."""
    for r in VLLM_LORA_RANKS:
        if r >= max_lora_rank:
            return r
    raise ConfigError(
        f"max_lora_rank {max_lora_rank} exceeds vLLM's largest LoRA rank {VLLM_LORA_RANKS[-1]}"
    )


class VllmSamplingBackend(SamplingBackend):
    """Generates with vLLM from the base model or from adapter checkpoint directories."""

    #: always known for this backend (the base class allows None)
    max_positions: int

    def __init__(
        self,
        model_dir: str,
        *,
        max_lora_rank: int = 64,
        max_loras: int = 8,
        max_cached_adapters: int = 32,
        engine_args: dict[str, Any] | None = None,
    ) -> None:
        """``max_loras``: adapters in one vLLM step (more wait for a later step);
        ``max_cached_adapters``: adapters vLLM keeps loaded in host memory and we keep ids for;
        ``engine_args``: extra ``vllm.LLM`` keyword arguments (dtype, max_model_len,
        gpu_memory_utilization, enforce_eager, ...), which override ours."""
        try:
            from vllm import LLM  # pyright: ignore[reportMissingImports]
        except ImportError as e:
            raise ConfigError(
                "sampler_type 'vllm' needs the vllm package, which is not installed: on a GPU "
                "machine `pip install -e '.[gpu]'`; on CPU see scripts/vllm_cpu_venv.sh "
                f"({type(e).__name__}: {e})"
            ) from None
        from transformers import AutoTokenizer

        self.max_lora_rank = int(max_lora_rank)
        self.max_cached_adapters = max(1, int(max_cached_adapters))
        args: dict[str, Any] = {
            "model": str(model_dir),
            "enable_lora": True,
            "max_lora_rank": vllm_lora_rank(self.max_lora_rank),
            "max_loras": max(1, int(max_loras)),
            "seed": 0,
        }
        args.update(engine_args or {})
        # vLLM requires max_cpu_loras >= max_loras (which engine_args may have raised)
        args.setdefault("max_cpu_loras", max(self.max_cached_adapters, int(args["max_loras"])))
        self.llm = LLM(**args)
        # The HF tokenizer (not vLLM's wrapper): the Sampler's text helpers call
        # apply_chat_template / decode on it exactly as on the torch backend's.
        self.tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        model_config = self.llm.llm_engine.model_config
        self.vocab_size = int(model_config.get_vocab_size())
        self.max_positions = int(model_config.max_model_len)
        eos = self.tokenizer.eos_token_id
        if eos is None:
            eos = getattr(model_config.hf_config, "eos_token_id", None)
        self.eos_ids = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
        # adapter directory → LoRARequest (engine/backends/adapter_cache.py)
        self._cache: AdapterDirCache[Any] = AdapterDirCache(self.max_cached_adapters)
        self._next_id = 1  # vLLM reserves 0 (no adapter)
        from vllm.platforms import current_platform  # pyright: ignore[reportMissingImports]

        # see the module docstring (CPU workaround); never evicted from our id cache
        self._base_lora = (
            self._zero_adapter(model_config.hf_config) if current_platform.is_cpu() else None
        )

    # ------------------------------------------------------------------------------- adapters

    def _lora_request(self, adapter_dir: str):
        """The LoRARequest of the adapter in ``adapter_dir``, loading (and so checking) it in vLLM
        on first use. CheckpointError when vLLM cannot load it."""
        return self._cache.get(adapter_dir, lambda p: self._load_lora(adapter_dir, p), self._forget)

    def _load_lora(self, adapter_dir: str, path: str):
        """A new LoRARequest for the adapter in ``path`` (realpath of ``adapter_dir``, which error
        messages name), loaded in vLLM now."""
        from vllm.lora.request import LoRARequest  # pyright: ignore[reportMissingImports]

        spec = read_adapter_config(path)  # CheckpointError for configs we cannot honour
        if spec.rank > self.max_lora_rank:
            raise CheckpointError(
                f"adapter checkpoint {adapter_dir}: LoRA rank {spec.rank} exceeds this sampler's "
                f"max_lora_rank {self.max_lora_rank}"
            )
        req = LoRARequest(f"sampler-{self._next_id}", self._next_id, path)
        self._next_id += 1
        # Load it now, alone: vLLM raises a bad adapter's error inside the engine step, which
        # would fail every request of the batch; here it fails only this request.
        try:
            self.llm.llm_engine.add_lora(req)
        except Exception as e:  # noqa: BLE001 - vLLM raises ValueError/RuntimeError/its own types
            detail = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
            hint = ""
            if "lm_head" in detail:
                hint = (
                    " (this model's vLLM implementation has no LoRA on lm_head: train with "
                    "train_unembed=False, or serve it with sampler_type: torch)"
                )
            raise CheckpointError(
                f"adapter checkpoint {adapter_dir} cannot be loaded by vLLM: {detail}{hint}"
            ) from None
        return req

    def _zero_adapter(self, hf_config):
        """A loaded LoRARequest whose adapter adds exactly 0: rank 1 on every layer's down_proj,
        A = B = 0 (the MLP output projection of Llama/Qwen/Mistral-style decoders)."""
        import torch
        from safetensors.torch import save_file
        from vllm.lora.request import LoRARequest  # pyright: ignore[reportMissingImports]

        hidden, inter = int(hf_config.hidden_size), int(hf_config.intermediate_size)
        tensors = {}
        for i in range(int(hf_config.num_hidden_layers)):
            key = f"base_model.model.model.layers.{i}.mlp.down_proj"
            tensors[f"{key}.lora_A.weight"] = torch.zeros(1, inter)
            tensors[f"{key}.lora_B.weight"] = torch.zeros(hidden, 1)
        self._zero_dir = tempfile.TemporaryDirectory(prefix="twinkle-zero-lora-")
        d = Path(self._zero_dir.name)
        save_file(tensors, str(d / ADAPTER_WEIGHTS_NAME), metadata={"format": "pt"})
        config = {
            "peft_type": "LORA",
            "r": 1,
            "lora_alpha": 1,
            "target_modules": ["down_proj"],
            "bias": "none",
            "task_type": "CAUSAL_LM",
        }
        (d / "adapter_config.json").write_text(json.dumps(config))
        req = LoRARequest("twinkle-base", self._next_id, str(d))
        self._next_id += 1
        self.llm.llm_engine.add_lora(req)
        return req

    def _forget(self, req) -> None:
        # best effort: vLLM may have evicted it already, which is fine
        with contextlib.suppress(Exception):
            self.llm.llm_engine.remove_lora(req.lora_int_id)

    def _trim_cache(self) -> None:
        """Drop least recently used ids beyond the cache size (after a batch: its adapters were
        all in use). A dropped directory gets a new id and is reloaded on its next use."""
        self._cache.trim(self._forget)

    def cached_adapter_dirs(self) -> list[str]:
        """Adapter directories with an id, least recently used first."""
        return self._cache.dirs()

    # ------------------------------------------------------------------------------- requests

    def _sampling_params(self, inp: SampleInput):
        from vllm import SamplingParams  # pyright: ignore[reportMissingImports]

        p = inp.params
        greedy = p.temperature == 0
        stop_ids = {int(t) for t in p.stop_token_ids}
        if p.stop_at_eos:
            stop_ids |= self.eos_ids
        return SamplingParams(
            n=1 if greedy else int(inp.num_samples),
            max_tokens=int(p.max_tokens),
            temperature=float(p.temperature),
            top_p=float(p.top_p),
            top_k=int(p.top_k),
            # same seed, same tokens; torch.Generator takes 64-bit seeds, vLLM's field int64
            seed=None if p.seed is None else int(p.seed) % (1 << 63),
            stop=list(p.stop_strings) or None,
            stop_token_ids=sorted(stop_ids),
            ignore_eos=not p.stop_at_eos,
            include_stop_str_in_output=True,
            skip_special_tokens=False,
            spaces_between_special_tokens=False,
            detokenize=bool(p.stop_strings),  # text is only needed to find stop strings
            logprobs=0,  # the sampled token's logprob only
            prompt_logprobs=0 if inp.prompt_logprobs else None,
        )

    def _output(self, inp: SampleInput, out) -> SampleOutput:
        seqs: list[SampledSequence] = []
        for c in sorted(out.outputs, key=lambda c: c.index):
            if c.finish_reason not in ("stop", "length"):
                raise BackendError(f"vLLM finished a sequence with reason {c.finish_reason!r}")
            tokens = [int(t) for t in c.token_ids]
            lps = c.logprobs or []
            if len(lps) != len(tokens):
                raise BackendError("vLLM returned no logprob for some sampled tokens")
            logprobs = [float(lps[j][t].logprob) for j, t in enumerate(tokens)]
            seqs.append(SampledSequence(tokens, logprobs, c.finish_reason))
        if inp.params.temperature == 0:  # one greedy row stands for all num_samples
            seqs = [
                SampledSequence(list(s.tokens), list(s.logprobs), s.stop_reason)
                for s in seqs[:1]
                for _ in range(inp.num_samples)
            ]
        prompt_lps = None
        if inp.prompt_logprobs:
            pl = out.prompt_logprobs or []
            prompt = inp.prompt_tokens
            if len(pl) != len(prompt):
                raise BackendError("vLLM returned prompt logprobs of the wrong length")
            prompt_lps = [math.nan] + [
                float(pl[j][int(prompt[j])].logprob) for j in range(1, len(prompt))
            ]
        return SampleOutput(sequences=seqs, prompt_logprobs=prompt_lps)

    def sample_many(
        self,
        inputs: Sequence[SampleInput],
        listeners: Sequence[TokenListener | None] | None = None,
    ) -> list[SampleOutput | EngineError]:
        """Generate for all ``inputs`` (any adapters and params) in one ``LLM.generate`` call.
        ``listeners`` are not called: ``LLM.generate`` returns whole outputs only, so a stream
        from this backend carries just the final output (see `SamplingBackend.sample_many`).

        Slot i gets input i's output, or the EngineError that input alone raised (validation, a
        missing or unloadable checkpoint); a failing input does not stop the others. Unexpected
        vLLM failures raise.
        """
        results: list[SampleOutput | EngineError | None] = [None] * len(inputs)
        ready: list[int] = []
        prompts, params, loras = [], [], []
        try:
            for i, inp in enumerate(inputs):
                try:
                    validate_sample_input(
                        inp, vocab_size=self.vocab_size, max_positions=self.max_positions
                    )
                    if inp.prompt_images:  # never dropped silently
                        raise UserInputError(
                            "prompt.chunks: image chunks are not supported by the vLLM sampler "
                            "yet; a VL model samples images with sampler_type: torch"
                        )
                    lora = (
                        self._lora_request(inp.adapter_dir) if inp.adapter_dir else self._base_lora
                    )
                    sp = self._sampling_params(inp)
                except EngineError as e:
                    results[i] = e
                    continue
                ready.append(i)
                prompts.append({"prompt_token_ids": [int(t) for t in inp.prompt_tokens]})
                params.append(sp)
                loras.append(lora)
            if ready:
                outs = self.llm.generate(prompts, params, lora_request=loras, use_tqdm=False)
                for i, out in zip(ready, outs, strict=True):
                    results[i] = self._output(inputs[i], out)
        finally:
            self._trim_cache()
        return results  # type: ignore[return-value]

    def close(self) -> None:
        """Stop vLLM's engine core (and its worker processes, if any) now, not at garbage
        collection; the backend is unusable afterwards. Idempotent."""
        engine_core = getattr(self.llm.llm_engine, "engine_core", None)
        shutdown = getattr(engine_core, "shutdown", None)
        if shutdown is not None:
            shutdown()

    def sample(self, inp: SampleInput) -> SampleOutput:
        """Generate ``inp.num_samples`` sequences for one prompt (raises its EngineError)."""
        out = self.sample_many([inp])[0]
        if isinstance(out, EngineError):
            raise out
        return out
