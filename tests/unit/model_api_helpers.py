"""Shared by the MultiLoraTransformersModel tests (tests/unit/test_model_api_*.py): texts, LoRA
config, HF-style datums, parameter snapshots, inputs converted to datums."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from engine.backends.lora import adapter_parameters
from engine.local.inputs import convert
from engine.local.model import MultiLoraTransformersModel
from engine.protocol import DatumInput

TEXTS = [
    "User: what is 12 plus 13? Assistant: 25.",
    "The small model reads every line of the corpus slowly and then it rests.",
    "def compute_batch(batch, token=None):\n    return batch + token",
    "User: what is the capital of France? Assistant: The capital of France is Paris.",
]


LORA = {"r": 4, "lora_alpha": 8, "target_modules": "all-linear", "seed": 1}


def hf(seq: list[int], prompt_len: int = 0) -> dict:
    """HF-style datum; the first ``prompt_len`` labels are ignored (-100)."""
    return {"input_ids": list(seq), "labels": [-100] * prompt_len + list(seq[prompt_len:])}


def new_model(model_dir: Path, **kw) -> MultiLoraTransformersModel:
    return MultiLoraTransformersModel(model_dir, **kw)


def params(m: MultiLoraTransformersModel, name: str = "default") -> dict[str, torch.Tensor]:
    return {k: p.detach().clone() for k, p in adapter_parameters(m.backend.model, name).items()}


def assert_params_close(a: dict, b: dict, atol: float | None = None) -> None:
    """Adapter parameters of two float32 trainings that should agree. ``atol=0``: bit-equal (the
    same computation). Otherwise relative to the largest parameter: the bound 8e-6 x scale equals
    the former absolute 1e-6 at this model's scale (about 0.13) and scales with it. Measured here
    (2026-12-03): 0 to 2e-9 x scale for the same rows in the same batches, 4.2e-7 x scale for
    half batches accumulated vs one full batch (other summation order, through AdamW): a 19x
    margin, while a lost micro-batch or a step on the wrong adapter moves parameters by >= 1e-3."""
    assert a.keys() == b.keys()
    if atol == 0:
        for k, v in a.items():
            torch.testing.assert_close(v, b[k], atol=0, rtol=0)
        return
    scale = max(float(t.abs().max()) for t in b.values())
    assert scale > 1e-3, scale  # not vacuous
    bound = 8e-6 * scale if atol is None else atol
    diff = max(float((v - b[k]).abs().max()) for k, v in a.items())
    assert diff <= bound, (diff, bound, scale)


def to_datums(inputs: Any, label_format: str = "rolled") -> list[DatumInput]:
    """The datums the model converts ``inputs`` to (`engine.local.inputs.convert`)."""
    return convert(inputs, label_format).data
