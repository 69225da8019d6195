"""Shared by the TorchSamplingBackend tests (tests/unit/test_torch_sampler*.py): prompts, the HF and
peft reference models, and sampling shortcuts."""

from __future__ import annotations

import warnings
from pathlib import Path

import torch

from engine.protocol import (
    SampleInput,
    SamplingParams,
)

CHATS = [
    "User: what is 12 plus 13? Assistant: 25.",
    "User: what is the capital of France? Assistant: The capital of France is Paris.",
    "User: describe Alice's pet. Assistant: Alice has a red cat that likes to sleep in the sun.",
]


def _hf(model_dir: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir).eval()


def _peft(model_dir: Path, adapter_dir: Path):
    from peft import PeftModel

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return PeftModel.from_pretrained(_hf(model_dir), str(adapter_dir)).eval()


def _prompt(sampler, text: str = "User: what is 12 plus 13? Assistant:") -> list[int]:
    return sampler.tokenizer(text)["input_ids"]


def _sample(sampler, prompt, adapter=None, n=1, prompt_logprobs=False, **params):
    inp = SampleInput(
        prompt_tokens=prompt,
        num_samples=n,
        params=SamplingParams(**params),
        prompt_logprobs=prompt_logprobs,
        adapter_dir=str(adapter) if adapter else None,
    )
    return sampler.sample(inp)


def _hf_greedy(model, prompt, max_new_tokens) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
        )
    return out[0, len(prompt) :].tolist()
