"""LoRA on a VL model's vision tower (``train_vision``, opt-in) on the tiny vision-language model:
the tower's block projections get the adapter only when asked; its rows are routed by image patch
(a fused batch of two tower-trained adapters, image rows and text rows equals each alone); the
PEFT export names the tower's modules and loads with ``peft`` on transformers' own VL class with
our logprobs (the independent check that our routing applies the tower's LoRA where peft does);
the torch sampler applies it from the exported files; a text model refuses it by name."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from engine.backends.lora import lora_layers
from engine.backends.sample_torch import TorchSamplingBackend
from engine.backends.train_transformers import TransformersTrainingBackend
from engine.errors import UserInputError
from engine.protocol import AdamParams, ForwardBackwardInput, LoraSpec, SampleInput, SamplingParams
from engine.rules import VISION_TARGETS, lora_spec_from_config
from tests.factories import png
from tests.unit.test_vision_training import _tok, image_datum, peft_image_logits, text_datum

pytest.importorskip("PIL")


@pytest.fixture(scope="module")
def be(tiny_vl_model_dir: Path) -> TransformersTrainingBackend:
    return TransformersTrainingBackend(str(tiny_vl_model_dir), base_model_name="twinkle/tiny-vl")


def _train(be, aid: str, data, steps: int, lr: float = 0.05) -> list[float]:
    out = []
    for _ in range(steps):
        fb = be.forward_backward(aid, ForwardBackwardInput(data))
        be.optim_step(aid, AdamParams(learning_rate=lr))
        out.append(fb.metrics["loss:sum"])
    return out


def _tower(be, aid: str) -> list[str]:
    return [
        layer.qualified_name
        for layer in lora_layers(be.model)
        if aid in layer.adapters and layer.vision
    ]


def test_the_tower_is_opt_in_and_trains(be, tiny_vl_model_dir):
    tok = _tok(tiny_vl_model_dir)
    be.create_adapter("lang", LoraSpec(rank=4, seed=1))
    be.create_adapter("tower", LoraSpec(rank=4, seed=1, train_vision=True))
    assert _tower(be, "lang") == []
    assert sorted(n.rsplit(".", 1)[-1] for n in _tower(be, "tower")) == sorted(VISION_TARGETS)
    data = [image_datum(tok, "OCR", png(s), s) for s in ("12", "34")]
    losses = _train(be, "tower", data, 6, lr=0.02)
    assert losses[-1] < losses[0]
    # the tower's B moved off its zero init: its gradient reached the vision blocks
    tower = [layer for layer in lora_layers(be.model) if layer.vision]
    assert all(float(layer.adapters["tower"].B.detach().abs().max()) > 0 for layer in tower)
    be.delete_adapter("lang")
    be.delete_adapter("tower")


def test_fused_batch_with_tower_adapters_equals_each_alone(be, tiny_vl_model_dir):
    """Patch segments: adapter a's image patches go through a's tower LoRA, b's through b's,
    whatever rows (with or without images) sit between them."""
    tok = _tok(tiny_vl_model_dir)
    be.create_adapter("va", LoraSpec(rank=4, seed=2, train_vision=True))
    be.create_adapter("vb", LoraSpec(rank=8, seed=3, train_vision=True))
    be.create_adapter("plain", LoraSpec(rank=4, seed=4))
    for aid in ("va", "vb", "plain"):
        _train(be, aid, [image_datum(tok, "OCR", png("7"), "7"), text_datum(tok, "hi there")], 1)
    a = [text_datum(tok, "text first"), image_datum(tok, "OCR", png("12"), "12")]
    b = [
        image_datum(tok, "read", png("3+4", (100, 70)), "3+4", expected=None, n_img=8),
        text_datum(tok, "a text row"),
        image_datum(tok, "OCR", png("9"), "9"),
    ]
    c = [image_datum(tok, "OCR", png("5"), "5")]
    jobs = [("va", a), ("plain", c), ("vb", b)]
    alone = [
        be.forward_backward(aid, ForwardBackwardInput(d, forward_only=True)) for aid, d in jobs
    ]
    fused = be.forward_backward_many(
        [(aid, ForwardBackwardInput(d, forward_only=True)) for aid, d in jobs]
    )
    for x, y in zip(alone, fused, strict=True):
        assert not isinstance(y, Exception)
        for ox, oy in zip(x.outputs, y.outputs, strict=True):
            np.testing.assert_allclose(oy["logprobs"], ox["logprobs"], atol=1e-5)
    # and the tower adapter matters: without it (a language-only twin) image rows differ
    lang = be.forward_backward("plain", ForwardBackwardInput(a, forward_only=True))
    assert not np.allclose(lang.outputs[1]["logprobs"], alone[0].outputs[1]["logprobs"], atol=1e-4)
    for aid in ("va", "vb", "plain"):
        be.delete_adapter(aid)


def test_export_loads_with_peft_and_the_torch_sampler_applies_it(be, tiny_vl_model_dir, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForImageTextToText

    tok = _tok(tiny_vl_model_dir)
    be.create_adapter("pv", LoraSpec(rank=8, seed=5, train_vision=True))
    data = [image_datum(tok, "OCR", png("5+5"), "5+5"), image_datum(tok, "OCR", png("ab"), "ab")]
    _train(be, "pv", data, 3, lr=0.02)
    ours = be.forward_backward("pv", ForwardBackwardInput(data[:1], forward_only=True))
    be.save_state("pv", str(tmp_path / "ckpt"), include_optimizer=False)
    be.delete_adapter("pv")
    cfg = json.loads((tmp_path / "ckpt" / "adapter_config.json").read_text())
    assert set(VISION_TARGETS) <= set(cfg["target_modules"])

    base = AutoModelForImageTextToText.from_pretrained(str(tiny_vl_model_dir)).float()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the tied lm_head warning
        pm = PeftModel.from_pretrained(base, str(tmp_path / "ckpt")).eval()
    wrapped = {n for n, _ in pm.named_modules() if n.endswith(".lora_A")}
    assert any(".visual.blocks.0.attn.qkv" in n for n in wrapped)
    assert not any(".merger." in n for n in wrapped)  # the merger is not a block projection
    x, logits = peft_image_logits(pm, be, data[0])
    tgt = torch.from_numpy(data[0].loss_fn_inputs["target_tokens"])
    theirs = torch.log_softmax(logits.double(), -1).gather(-1, tgt[:, None])[:, 0].numpy()
    np.testing.assert_allclose(ours.outputs[0]["logprobs"], theirs, atol=1e-4)

    # the torch sampler reads the same files: its prompt logprobs equal peft's on the image row
    sampler = TorchSamplingBackend(str(tiny_vl_model_dir))
    out = sampler.sample(
        SampleInput(
            prompt_tokens=list(data[0].tokens),
            prompt_images=list(data[0].images),
            prompt_logprobs=True,
            adapter_dir=str(tmp_path / "ckpt"),
            params=SamplingParams(max_tokens=1, temperature=0.0),
        )
    )
    full = torch.log_softmax(logits.double(), -1)
    want = full[:-1].gather(-1, x[0, 1:, None])[:, 0].numpy()
    got = np.asarray(out.prompt_logprobs[1:], dtype=np.float64)
    np.testing.assert_allclose(got, want, atol=1e-4)


def test_a_text_model_refuses_train_vision(tiny_model_dir):
    be = TransformersTrainingBackend(str(tiny_model_dir), base_model_name="twinkle/tiny-chat")
    with pytest.raises(UserInputError, match=r"lora_config.train_vision: model twinkle/tiny-chat"):
        be.create_adapter("x", LoraSpec(rank=4, train_vision=True))
    be.create_adapter("y", LoraSpec(rank=4))  # and it keeps working


@pytest.mark.parametrize(
    ("config", "vision", "attn"),
    [
        ({"r": 8}, False, True),
        ({"r": 8, "target_modules": "all-linear"}, False, True),
        ({"r": 8, "train_vision": True}, True, True),
        (
            {
                "r": 8,
                "target_modules": [
                    "q_proj",
                    "k_proj",
                    "v_proj",
                    "o_proj",
                    "qkv",
                    "proj",
                    "fc1",
                    "fc2",
                ],
            },
            True,
            True,
        ),
        ({"r": 8, "target_modules": ["qkv", "proj", "fc1", "fc2"]}, True, False),
    ],
)
def test_lora_configs_opt_into_the_tower(config, vision, attn):
    spec = lora_spec_from_config(config)
    assert (spec.train_vision, spec.train_attn) == (vision, attn)


def test_lora_config_train_vision_must_be_a_bool():
    with pytest.raises(UserInputError, match="train_vision 'yes' must be true or false"):
        lora_spec_from_config({"r": 8, "train_vision": "yes"})
    with pytest.warns(UserWarning, match="also training"):
        assert lora_spec_from_config({"r": 8, "target_modules": ["qkv"]}).train_vision
