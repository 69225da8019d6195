"""Shared by the TransformersTrainingBackend tests (tests/unit/test_training_backend*.py): texts,
datums, a float64 reference and a logprob comparison."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch import nn

from engine.backends.train_transformers import TransformersTrainingBackend
from engine.protocol import DatumInput, ForwardBackwardInput

TEXTS = [
    "User: what is 12 plus 13? Assistant: 25.",
    "The small model reads every line of the corpus slowly and then it rests.",
    "def compute_batch(batch, token=None):\n    return batch + token",
    "User: what is the capital of France? Assistant: The capital of France is Paris.",
]


def assert_logprobs_close(a, b) -> None:
    """Logprobs of the same rows from two float32 passes with other batch compositions (padding,
    micro-batches, extra target columns): the GEMMs and log-softmax sums round in another order.
    Measured here (2026-12-03): at most 4.8e-7 (one float32 ulp at |logprob| ~ 8); the bound,
    1e-6 x max(1, largest |logprob|) (about 8 ulps), leaves a 17x margin and stays far below what a
    leaked pad token or a wrong row does (>= 1e-3)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    scale = max(1.0, float(np.abs(b).max()))
    np.testing.assert_allclose(a, b, atol=1e-6 * scale, rtol=0)


def backend(model_dir: Path, **kw) -> TransformersTrainingBackend:
    return TransformersTrainingBackend(str(model_dir), base_model_name="twinkle/tiny-chat", **kw)


def datum(seq: np.ndarray, weights: np.ndarray | None = None) -> DatumInput:
    w = np.ones(len(seq) - 1, np.float32) if weights is None else weights
    return DatumInput(
        tokens=seq[:-1].tolist(), loss_fn_inputs={"target_tokens": seq[1:], "weights": w}
    )


def fb(be, aid, data, forward_only=False):
    return be.forward_backward(aid, ForwardBackwardInput(data=data, forward_only=forward_only))


def params_of(be, aid) -> dict[str, torch.Tensor]:
    from engine.backends.lora import adapter_parameters

    return {k: p.detach().clone() for k, p in adapter_parameters(be.model, aid).items()}


def reference_logprobs(model_dir: Path, be, aid: str, tokens, targets) -> np.ndarray:
    """log p(targets) from a float64 HF model with the adapter's deltas merged into its weights."""
    from transformers import AutoModelForCausalLM

    spec = be.adapter_spec(aid)
    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64).eval()
    ref.lm_head.weight = nn.Parameter(ref.lm_head.weight.detach().clone())  # untie
    params = params_of(be, aid)
    with torch.no_grad():
        for key, a in params.items():
            if key.endswith("lora_A.weight"):
                b = params[key.replace("lora_A", "lora_B")]
                name = key[len("base_model.model.") : -len(".lora_A.weight")]
                ref.get_submodule(name).weight += (spec.alpha / spec.rank) * b.double() @ a.double()
        logits = ref(torch.tensor([tokens])).logits[0]
    lp = torch.log_softmax(logits, -1)
    return lp[torch.arange(len(tokens)), torch.tensor(targets)].numpy()
