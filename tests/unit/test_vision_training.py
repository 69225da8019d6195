"""Images in training on the tiny vision-language model (engine/backends/vision.py, the
Transformers training backend): Tinker-style image chunks expanded server-side equal transformers'
own processor; image chunks and upstream's pre-processed ``pixel_values`` give the same loss; a
fused batch of text rows, image rows and two adapters equals each alone; bad images are refused
naming the field."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest

from engine.backends.train_transformers import TransformersTrainingBackend
from engine.errors import UserInputError
from engine.protocol import DatumInput, ForwardBackwardInput, ImagePart, LoraSpec
from engine.rules import VISION_TARGETS
from tests.factories import png
from tests.unit.training_backend_helpers import assert_logprobs_close

PIL = pytest.importorskip("PIL")


@pytest.fixture(scope="module")
def be(tiny_vl_model_dir: Path) -> TransformersTrainingBackend:
    return TransformersTrainingBackend(str(tiny_vl_model_dir), base_model_name="twinkle/tiny-vl")


def _tok(model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


def image_datum(
    tok, text: str, image: bytes, answer: str, expected: int | None = 4, n_img: int = 4
) -> DatumInput:
    """``<|im_start|>user\\n<|vision_start|>[image]<|vision_end|>{text}...`` as a Tinker client
    sends it: text tokens with one image chunk; targets sized text + ``n_img`` image tokens (a
    56x56 image: 4x4 patches of 14, merged 2x2 = 4)."""
    before = tok.encode("<|im_start|>user\n<|vision_start|>", add_special_tokens=False)
    after = tok.encode(
        f"<|vision_end|>{text}<|im_end|>\n<|im_start|>assistant\n{answer}<|im_end|>",
        add_special_tokens=False,
    )
    full = before + [0] * n_img + after
    targets = np.asarray(full[1:] + [tok.pad_token_id], dtype=np.int64)
    weights = np.zeros(len(full), np.float32)
    weights[-len(tok.encode(answer + "<|im_end|>", add_special_tokens=False)) - 1 : -1] = 1.0
    part = ImagePart(
        data=image, format="png", position=len(before), expected_tokens=expected, chunk_index=1
    )
    return DatumInput(
        tokens=before + after,
        loss_fn_inputs={"target_tokens": targets, "weights": weights},
        images=[part],
    )


def text_datum(tok, text: str) -> DatumInput:
    ids = tok.encode(text, add_special_tokens=False)
    return DatumInput(
        tokens=ids[:-1],
        loss_fn_inputs={
            "target_tokens": np.asarray(ids[1:], np.int64),
            "weights": np.ones(len(ids) - 1, np.float32),
        },
    )


def test_expansion_equals_transformers_processor(be, tiny_vl_model_dir):
    """Our expansion + pixels = transformers' Qwen2-VL processor on the same text and image
    (built as an image-only subclass: the stock one needs torchvision)."""
    from transformers import AutoImageProcessor, Qwen2VLProcessor
    from transformers.processing_utils import ProcessorMixin

    tok = _tok(tiny_vl_model_dir)

    class ImageOnly(Qwen2VLProcessor):
        def __init__(self, image_processor, tokenizer):
            self.image_token = "<|image_pad|>"
            self.video_token = None  # no video: the tiny model has no video token
            self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
            self.video_token_id = self.image_token_id
            ProcessorMixin.__init__(self, image_processor, tokenizer)

    proc = ImageOnly(AutoImageProcessor.from_pretrained(str(tiny_vl_model_dir)), tok)
    for size in [(56, 56), (100, 70), (30, 200)]:
        img = png("x+1", size)
        from PIL import Image

        ref = proc(
            text=["<|vision_start|><|image_pad|><|vision_end|>read"],
            images=[Image.open(io.BytesIO(img))],
            return_tensors="np",
        )
        before = tok.encode("<|vision_start|>", add_special_tokens=False)
        after = tok.encode("<|vision_end|>read", add_special_tokens=False)
        part = ImagePart(data=img, format="png", position=len(before))
        assert be.vision is not None
        ids, vis = be.vision.expand(before + after, [part], "data[0].model_input")
        assert ids == ref["input_ids"][0].tolist()
        np.testing.assert_array_equal(vis.pixel_values, ref["pixel_values"])
        np.testing.assert_array_equal(vis.grid_thw, ref["image_grid_thw"])


def test_image_chunk_and_preprocessed_pixels_give_the_same_loss(be, tiny_vl_model_dir):
    tok = _tok(tiny_vl_model_dir)
    be.create_adapter("same", LoraSpec(rank=4, seed=1))
    d = image_datum(tok, "OCR", png("42"), "42")
    out_chunk = be.forward_backward("same", ForwardBackwardInput([d], forward_only=True))
    assert be.vision is not None
    ids, vis = be.vision.expand(d.tokens, d.images, "x")
    up = DatumInput(
        tokens=ids,
        loss_fn_inputs={
            **d.loss_fn_inputs,
            "pixel_values": vis.pixel_values,
            "image_grid_thw": vis.grid_thw,
        },
    )
    out_up = be.forward_backward("same", ForwardBackwardInput([up], forward_only=True))
    a, b = out_chunk.outputs[0]["logprobs"], out_up.outputs[0]["logprobs"]
    assert len(a) == len(ids)
    np.testing.assert_allclose(a, b, atol=1e-5)
    assert out_chunk.metrics["loss:sum"] == pytest.approx(out_up.metrics["loss:sum"], abs=1e-5)
    # the image changes what the model predicts: another image, other logprobs
    other = image_datum(tok, "OCR", png("97"), "42")
    out_other = be.forward_backward("same", ForwardBackwardInput([other], forward_only=True))
    assert np.abs(out_other.outputs[0]["logprobs"] - a).max() > 1e-4
    be.delete_adapter("same")


def test_mixed_batch_of_text_image_rows_and_two_adapters_equals_each_alone(be, tiny_vl_model_dir):
    tok = _tok(tiny_vl_model_dir)
    be.create_adapter("ta", LoraSpec(rank=4, seed=2))
    be.create_adapter("tb", LoraSpec(rank=8, seed=3))
    # give both adapters non-zero B so LoRA routing matters
    for aid in ("ta", "tb"):
        data = [image_datum(tok, "OCR", png("7"), "7"), text_datum(tok, "hello world, hello")]
        be.forward_backward(aid, ForwardBackwardInput(data))
        from engine.protocol import AdamParams

        be.optim_step(aid, AdamParams(learning_rate=0.05))
    a_data = [image_datum(tok, "OCR", png("12"), "12"), text_datum(tok, "the quick brown fox")]
    b_data = [
        text_datum(tok, "a text row only"),
        image_datum(tok, "read", png("3+4", (100, 70)), "3+4", expected=None, n_img=8),
    ]
    alone = [
        be.forward_backward(aid, ForwardBackwardInput(d, forward_only=True))
        for aid, d in (("ta", a_data), ("tb", b_data))
    ]
    fused = be.forward_backward_many(
        [
            ("ta", ForwardBackwardInput(a_data, forward_only=True)),
            ("tb", ForwardBackwardInput(b_data, forward_only=True)),
        ]
    )
    for x, y in zip(alone, fused, strict=True):
        assert not isinstance(y, Exception)
        for ox, oy in zip(x.outputs, y.outputs, strict=True):
            assert_logprobs_close(oy["logprobs"], ox["logprobs"])
            np.testing.assert_allclose(oy["logprobs"], ox["logprobs"], atol=1e-5)
    be.delete_adapter("ta")
    be.delete_adapter("tb")


def test_training_on_images_lowers_the_loss(be, tiny_vl_model_dir):
    from engine.protocol import AdamParams

    tok = _tok(tiny_vl_model_dir)
    be.create_adapter("learn", LoraSpec(rank=8, seed=4))
    data = [image_datum(tok, "OCR", png(s), s) for s in ("12", "34", "56", "78")]
    losses = []
    for _ in range(12):
        out = be.forward_backward("learn", ForwardBackwardInput(data))
        be.optim_step("learn", AdamParams(learning_rate=0.02))
        losses.append(out.metrics["loss:sum"])
    assert losses[-1] < 0.6 * losses[0], losses
    be.delete_adapter("learn")


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"format": "gif"}, "data[0].model_input.chunks[1].format: 'gif' is not supported"),
        ({"format": "jpeg"}, "chunks[1].format: declared 'jpeg' but the bytes are png"),
        ({"data": b"not an image"}, "chunks[1].data: not a decodable png image"),
        ({"data": "trunc"}, "chunks[1].data: truncated or corrupt png image"),
        ({"expected_tokens": 9}, "chunks[1].expected_tokens: 9, but this server's image "),
        ({"data": "huge"}, "pixels; this server's limit is"),
    ],
)
def test_bad_images_are_refused_naming_the_field(be, tiny_vl_model_dir, change, message):
    tok = _tok(tiny_vl_model_dir)
    be.create_adapter("bad", LoraSpec(rank=4))
    d = image_datum(tok, "OCR", png("1"), "1")
    part = d.images[0]
    if change.get("data") == "trunc":
        change = {"data": png("1", (112, 112))[:-40]}
    elif change.get("data") == "huge":
        change = {"data": png("1", (5000, 4000))}
    from dataclasses import replace

    d.images[0] = replace(part, **change)
    with pytest.raises(UserInputError, match=message.replace("(", r"\(").replace("[", r"\[")):
        be.forward_backward("bad", ForwardBackwardInput([d]))
    be.delete_adapter("bad")


def test_preprocessed_pixels_must_match_the_image_tokens(be, tiny_vl_model_dir):
    tok = _tok(tiny_vl_model_dir)
    be.create_adapter("pre", LoraSpec(rank=4))
    d = image_datum(tok, "OCR", png("1"), "1")
    assert be.vision is not None
    ids, vis = be.vision.expand(d.tokens, d.images, "x")
    bad_grid = DatumInput(
        tokens=ids,
        loss_fn_inputs={
            **d.loss_fn_inputs,
            "pixel_values": vis.pixel_values,
            "image_grid_thw": np.asarray([[1, 4, 8]]),
        },
    )
    with pytest.raises(UserInputError, match=r"data\[0\]\.loss_fn_inputs\.pixel_values: shape"):
        be.forward_backward("pre", ForwardBackwardInput([bad_grid]))
    missing = DatumInput(
        tokens=ids, loss_fn_inputs={**d.loss_fn_inputs, "pixel_values": vis.pixel_values}
    )
    with pytest.raises(UserInputError, match=r"loss_fn_inputs\.image_grid_thw: required"):
        be.forward_backward("pre", ForwardBackwardInput([missing]))
    be.delete_adapter("pre")


def test_a_text_model_refuses_images(tiny_model_dir):
    from tests.unit.training_backend_helpers import backend

    text_be = backend(tiny_model_dir)
    text_be.create_adapter("t", LoraSpec(rank=4))
    d = DatumInput(
        tokens=[1, 2, 3],
        loss_fn_inputs={"target_tokens": np.asarray([2, 3, 4, 5, 6, 7, 8])},
        images=[ImagePart(data=png("1"), format="png", position=1, chunk_index=1)],
    )
    with pytest.raises(UserInputError, match="model_input.chunks: image chunks: this base model"):
        text_be.forward_backward("t", ForwardBackwardInput([d]))


def test_upstream_rows_with_pixel_values_through_the_native_model(tiny_vl_model_dir):
    """Upstream Twinkle's multi-modal rows (input_ids with the image tokens expanded, rolled
    labels, ``pixel_values`` / ``image_grid_thw`` as JSON lists, as its client sends them) give
    the loss of the same data as a Tinker image chunk."""
    from engine.local.model import MultiLoraTransformersModel

    tok = _tok(tiny_vl_model_dir)
    m = MultiLoraTransformersModel(tiny_vl_model_dir)
    m.add_adapter_to_model("default", {"r": 4, "lora_alpha": 8, "target_modules": "all-linear"})
    d = image_datum(tok, "OCR", png("42"), "42")
    assert m.backend.vision is not None
    ids, vis = m.backend.vision.expand(d.tokens, d.images, "x")
    w = d.loss_fn_inputs["weights"]
    labels = np.where(w > 0, d.loss_fn_inputs["target_tokens"], -100)
    row = {
        "input_ids": ids,
        "labels": labels.tolist(),
        "attention_mask": [1] * len(ids),
        "pixel_values": vis.pixel_values.tolist(),
        "image_grid_thw": vis.grid_thw.tolist(),
        "messages": [{"role": "user", "content": "<image>OCR"}],
    }
    ours = m.forward_only([row])
    # a fresh adapter (B = 0) computes what the new "default" does: the same loss for the chunk
    m.backend.create_adapter("ref", LoraSpec(rank=4))
    ref = m.backend.forward_backward("ref", ForwardBackwardInput([d], forward_only=True))
    assert ours["loss_sum"] == pytest.approx(ref.metrics["loss:sum"], abs=1e-5)
    assert ours["loss_sum"] > 0
    # and it trains
    out = m.forward_backward([row])
    assert out["loss"] > 0


def test_a_vl_adapter_exports_in_peft_format_and_loads_with_peft(be, tiny_vl_model_dir, tmp_path):
    """The saved adapter loads with ``peft`` on transformers' own VL model and gives our
    logprobs on an image row (the vision tower untouched, LoRA on the language model)."""
    import json
    import warnings

    import torch
    from peft import PeftModel
    from transformers import AutoModelForImageTextToText

    from engine.protocol import AdamParams

    tok = _tok(tiny_vl_model_dir)
    be.create_adapter("peft", LoraSpec(rank=8, seed=5))
    data = [image_datum(tok, "OCR", png("5+5"), "5+5"), image_datum(tok, "OCR", png("ab"), "ab")]
    for _ in range(3):
        be.forward_backward("peft", ForwardBackwardInput(data))
        be.optim_step("peft", AdamParams(learning_rate=0.02))
    ours = be.forward_backward("peft", ForwardBackwardInput(data[:1], forward_only=True))
    be.save_state("peft", str(tmp_path / "ckpt"), include_optimizer=False)
    cfg = json.loads((tmp_path / "ckpt" / "adapter_config.json").read_text())
    assert not set(VISION_TARGETS) & set(cfg["target_modules"])  # the tower is opt-in
    base = AutoModelForImageTextToText.from_pretrained(str(tiny_vl_model_dir)).float()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the tied lm_head warning
        pm = PeftModel.from_pretrained(base, str(tmp_path / "ckpt")).eval()
    _, logits = peft_image_logits(pm, be, data[0])
    tgt = torch.from_numpy(data[0].loss_fn_inputs["target_tokens"])
    theirs = torch.log_softmax(logits.double(), -1).gather(-1, tgt[:, None])[:, 0].numpy()
    np.testing.assert_allclose(ours.outputs[0]["logprobs"], theirs, atol=1e-4)
    be.delete_adapter("peft")


def peft_image_logits(pm, be, d: DatumInput):
    """(expanded ids [1, T], logits [T, V]) of a peft model on datum ``d``'s text and image, the
    image processed by the backend's `Vision` (as the engine does)."""
    import torch

    assert be.vision is not None
    ids, vis = be.vision.expand(d.tokens, d.images, "x")
    x = torch.tensor([ids])
    with torch.no_grad():
        logits = pm(
            input_ids=x,
            pixel_values=torch.from_numpy(vis.pixel_values),
            image_grid_thw=torch.from_numpy(vis.grid_thw),
            mm_token_type_ids=(x == be.vision.image_token_id).long(),
        ).logits[0]
    return x, logits
