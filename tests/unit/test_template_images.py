"""The native template (gateway/twinkle_api/templates.py) with images: ``<image>`` in a message
with its image in ``images`` renders as the model's vision tokens, the image travels as a data:
URL to the engine, which expands it like upstream's pre-processed rows; bad input is a 400 naming
the field."""

from __future__ import annotations

import base64
import re
from pathlib import Path

import numpy as np
import pytest

from gateway.errors import InvalidRequestError
from gateway.twinkle_api.templates import ChatEncoder, load_tokenizer
from tests.factories import png

pytest.importorskip("PIL")


def url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def traj(images: list, content: str = "<image>Read it.") -> dict:
    return {
        "messages": [
            {"role": "user", "content": content, "images": images},
            {"role": "assistant", "content": "42"},
        ]
    }


@pytest.fixture(scope="module")
def enc(tiny_vl_model_dir: Path) -> ChatEncoder:
    return ChatEncoder(load_tokenizer(str(tiny_vl_model_dir)), {})


def test_image_placeholder_renders_the_vision_tokens(enc, tiny_vl_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_vl_model_dir))
    img = url(png("42"))
    f = enc.encode(traj([img]))
    want = tok.apply_chat_template(
        [
            {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Read it."}]},
            {"role": "assistant", "content": "42"},
        ],
        tokenize=False,
    )
    assert f["input_ids"] == tok.encode(want, add_special_tokens=False)
    assert f["images"] == [img]
    vision = set(tok.convert_tokens_to_ids(["<|vision_start|>", "<|image_pad|>", "<|vision_end|>"]))
    assert not any(lab in vision for lab in f["labels"])  # image tokens are never trained
    # the sampler's view: the image token taken out, the image at its place
    prompt = enc.prompt_tokens({"messages": traj([img])["messages"][:1]}, "inputs[0]")
    text, parts = enc.sample_input_parts({"messages": traj([img])["messages"][:1]}, prompt, "x")
    assert len(text) == len(prompt) - 1 and parts[0].position == prompt.index(
        tok.convert_tokens_to_ids("<|image_pad|>")
    )


def test_the_engine_expands_a_rendered_row_like_upstreams_rows(enc, tiny_vl_model_dir):
    from transformers import AutoConfig

    from engine.backends.vision import Vision
    from engine.protocol import ImagePart

    vision = Vision(
        tiny_vl_model_dir, AutoConfig.from_pretrained(tiny_vl_model_dir), max_image_pixels=1 << 24
    )
    data = png("42", (112, 28))
    f = enc.encode(traj([url(data)]))
    f["labels"] = f["labels"][1:] + [-100]  # rolled, as the client's template sends it
    row = vision.expand_row({**f, "attention_mask": [1] * len(f["input_ids"])}, "inputs[0]")
    marker = f["input_ids"].index(vision.image_token_id)
    ids, vis = vision.expand(
        f["input_ids"][:marker] + f["input_ids"][marker + 1 :],
        [ImagePart(data, "png", marker)],
        "x",
    )
    assert row["input_ids"] == ids and len(row["labels"]) == len(ids)
    np.testing.assert_array_equal(row["pixel_values"], vis.pixel_values)
    assert row["labels"][marker : marker + 4] == [-100] * 4 and "images" not in row


@pytest.mark.parametrize(
    ("item", "message"),
    [
        (traj([]), "messages[0].images: 0 images for 1 <image> placeholders"),
        (traj(["x", "y"]), "messages[0].images: 2 images for 1 <image> placeholders"),
        (traj(["https://example.com/a.png"]), "messages[0].images[0]: only data: URLs"),
        (traj(["data:image/gif;base64,R0lG"]), "messages[0].images[0]: media type 'image/gif'"),
        (traj([b"raw"]), "messages[0].images[0]: must be a data:image/png|jpeg;base64 URL"),
    ],
)
def test_bad_images_are_a_400_naming_the_field(enc, item, message):
    with pytest.raises(InvalidRequestError, match=re.escape(message)):
        enc.encode(item, field="inputs[0]")


def test_a_text_model_refuses_images(tiny_model_dir):
    enc = ChatEncoder(load_tokenizer(str(tiny_model_dir)), {})
    with pytest.raises(
        InvalidRequestError, match="messages\\[0\\].images: this base model is text"
    ):
        enc.encode(traj([url(png("1"))]), field="inputs[0]")
