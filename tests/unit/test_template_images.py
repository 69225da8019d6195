"""A native trajectory with images (engine/sampler_text.py renders it, the gateway checks its data:
URLs): ``<image>`` in a message with its image in ``images`` renders as the model's own chat
template renders an image part, the image travels as a data: URL to the engine, which expands it
like upstream's pre-processed rows; bad input is a 400 naming the field."""

from __future__ import annotations

import asyncio
import base64
import re
from pathlib import Path

import numpy as np
import pytest

from engine.errors import UserInputError
from engine.sampler_text import render_trajectory
from gateway.errors import InvalidRequestError
from gateway.twinkle_api.sampling import NativeTemplate
from gateway.twinkle_api.templates import checked_images
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
def tok(tiny_vl_model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_vl_model_dir))


class _Sampler:
    """The Sampler's text methods on a local tokenizer, as `NativeTemplate` calls them."""

    def __init__(self, tok) -> None:
        self.tok = tok
        self.image_id = tok.convert_tokens_to_ids("<|image_pad|>")

    async def encode_trajectory(self, messages, *, add_generation_prompt, options, field):
        return render_trajectory(
            self.tok,
            messages,
            image_token_id=self.image_id,
            add_generation_prompt=add_generation_prompt,
            options=options,
            field=field,
        )

    async def image_token_id(self):
        return self.image_id


def encode(tok, item: dict, **kw) -> dict:
    template = NativeTemplate(_Sampler(tok), {})  # type: ignore[arg-type]  # a stand-in
    return asyncio.run(template.encode(item, field="inputs[0]", **kw))


def test_image_placeholder_renders_the_vision_tokens(tok):
    img = url(png("42"))
    f = encode(tok, traj([img]))
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
    assert tok.decode([lab for lab in f["labels"] if lab != -100]) == "42<|im_end|>"
    # the sampler's view: the image token taken out, the image at its place
    enc = NativeTemplate(_Sampler(tok), {})  # type: ignore[arg-type]
    item = {"messages": traj([img])["messages"][:1]}

    async def view():
        prompt = await enc.prompt_tokens(item, "inputs[0]")
        return prompt, await enc.sample_input_parts(item, prompt, "x")

    prompt, (text, parts) = asyncio.run(view())
    assert len(text) == len(prompt) - 1 and parts[0].position == prompt.index(
        tok.convert_tokens_to_ids("<|image_pad|>")
    )


def test_the_engine_expands_a_rendered_row_like_upstreams_rows(tok, tiny_vl_model_dir):
    from transformers import AutoConfig

    from engine.backends.vision import Vision
    from engine.protocol import ImagePart

    vision = Vision(
        tiny_vl_model_dir, AutoConfig.from_pretrained(tiny_vl_model_dir), max_image_pixels=1 << 24
    )
    data = png("42", (112, 28))
    f = encode(tok, traj([url(data)]))
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


ENGINE, GATEWAY = UserInputError, InvalidRequestError


@pytest.mark.parametrize(
    ("item", "error", "message"),
    [
        (traj([]), ENGINE, "messages[0].images: 0 images for 1 <image> placeholders"),
        (traj(["x", "y"]), ENGINE, "messages[0].images: 2 images for 1 <image> placeholders"),
        (traj(["https://example.com/a.png"]), GATEWAY, "messages[0].images[0]: only data: URLs"),
        (traj(["data:image/gif;base64,R0lG"]), GATEWAY, "images[0]: media type 'image/gif'"),
        (traj([b"raw"]), GATEWAY, "images[0]: must be a data:image/png|jpeg;base64 URL"),
    ],
)
def test_bad_images_are_a_400_naming_the_field(tok, item, error, message):
    """Both errors answer 400 invalid_request (gateway/errors.py); the count is the engine's to
    check (it renders the placeholders), the data: URLs the gateway's."""
    with pytest.raises(error, match=re.escape(message)):
        encode(tok, item)


def test_a_text_model_refuses_images(tiny_model_dir):
    from transformers import AutoTokenizer

    text_tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    with pytest.raises(UserInputError, match="messages\\[0\\].images: this base model is text"):
        render_trajectory(
            text_tok,
            traj([url(png("1"))])["messages"],
            image_token_id=None,
            add_generation_prompt=False,
            options={},
            field="inputs[0]",
        )
    with pytest.raises(InvalidRequestError, match="messages\\[0\\].images\\[0\\]: only data"):
        checked_images(traj(["http://x"])["messages"], "inputs[0]")
