"""Images in the OpenAI chat API: ``image_url`` parts with ``data:`` URLs on the tiny VL
model (``twinkle/tiny-vl``, a real in-process Sampler next to the tiny chat model's engine), driven
by the official `openai` package: whole and streamed completions, greedy output equal to the
engine's own sampling of the same tokens and image, the image changing the answer; every bad input
(remote URL, bad base64, unsupported media type, undecodable bytes, caps, a text-only model) a
4xx naming ``messages[i].content[k]``, with the server answering afterwards."""

from __future__ import annotations

import asyncio
import base64
import io
from types import SimpleNamespace

import numpy as np
import pytest

from engine.protocol import ImagePart, SampleInput, SamplingParams
from tests.factories import png
from tests.gateway.harness import BASE, build_engines
from tests.gateway.openai_helpers import oai
from tests.tiny_models import seed_models

pytest.importorskip("PIL")

VL = "twinkle/tiny-vl"
MAX_BYTES = 2048  # the VL model's images.max_bytes here
MAX_IMAGES = 2  # its images.max_per_request


def data_url(data: bytes, media: str = "image/png") -> str:
    return f"data:{media};base64,{base64.b64encode(data).decode()}"


def image_messages(url: str, text: str = "Read the formula.") -> list[dict]:
    """A system message, then the user's text and image: the image is messages[1].content[1]."""
    return [
        {"role": "system", "content": "You read images."},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": text},
                {"type": "image_url", "image_url": {"url": url, "detail": "low"}},
            ],
        },
    ]


@pytest.fixture(scope="module")
def env(make_gateway, tmp_path_factory):
    from engine.config import ModelConfig
    from engine.sampler import Sampler

    data = tmp_path_factory.mktemp("openai-images")
    seed_models(data)
    limits = {"max_per_request": MAX_IMAGES, "max_bytes": MAX_BYTES}
    engines = build_engines(data)[0]
    vl = ModelConfig.model_validate({"name": VL, "images": limits})
    engines[VL] = {"sampler": Sampler(vl, str(data))}
    # the gateway checks the caps against its own config: the VL model with the same small caps
    models = [{"name": BASE}, {"name": VL, "images": limits}]
    gw = make_gateway(data=data, engines=engines, models=models)
    return SimpleNamespace(
        client=gw.client,
        keys={"alice": gw.key("alice")},
        vl=engines[VL]["sampler"],
    )


def post(env, body: dict):
    return env.client.post(
        "/v1/chat/completions",
        json={"model": VL, "max_tokens": 6, "temperature": 0, **body},
        headers={"Authorization": f"Bearer {env.keys['alice']}"},
    )


def direct_greedy(env, image: bytes, text: str, max_tokens: int):
    """The VL Sampler itself on hand-built tokens (the template's text around the image) and the
    image: what the API's greedy answer must equal."""
    tok = env.vl.backend.tokenizer
    before = tok.encode(
        f"<|im_start|>system\nYou read images.<|im_end|>\n<|im_start|>user\n{text}<|vision_start|>",
        add_special_tokens=False,
    )
    after = tok.encode(
        "<|vision_end|><|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False
    )
    inp = SampleInput(
        prompt_tokens=before + after,
        prompt_images=[ImagePart(image, "png", len(before))],
        params=SamplingParams(max_tokens=max_tokens, temperature=0.0, stop_at_eos=True),
    )
    seq = asyncio.run(env.vl.sample(inp)).sequences[0]
    return tok.decode(seq.tokens, skip_special_tokens=True), list(seq.logprobs), len(before + after)


def test_greedy_image_chat_equals_the_engine_and_the_image_is_used(env):
    answers = {}
    for label in ("42", "x+y"):
        img = png(label)
        res = oai(env).chat.completions.create(
            model=VL,
            messages=image_messages(data_url(img)),  # type: ignore[arg-type]
            max_tokens=10,
            temperature=0,
            logprobs=True,
        )
        text, lps, n_text = direct_greedy(env, img, "Read the formula.", 10)
        choice = res.choices[0]
        assert choice.message.content == text
        assert choice.logprobs is not None and choice.logprobs.content is not None
        got = [t.logprob for t in choice.logprobs.content]
        np.testing.assert_allclose(got, lps, atol=1e-5)
        assert res.usage is not None and res.usage.prompt_tokens == n_text + 1  # image = 1 token
        answers[label] = (text, got)
    # another image, another answer (or at least other logprobs): the image reaches the model
    (ta, la), (tb, lb) = answers.values()
    assert ta != tb or len(la) != len(lb) or not np.allclose(la, lb, atol=1e-4)


def test_image_chat_streamed_equals_whole(env):
    kw = {
        "model": VL,
        "messages": image_messages(data_url(png("7*8"))),
        "max_tokens": 12,
        "temperature": 0,
    }
    whole = oai(env).chat.completions.create(**kw)  # type: ignore[call-overload]
    chunks = list(
        oai(env).chat.completions.create(**kw, stream=True, stream_options={"include_usage": True})  # type: ignore[call-overload]
    )
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == whole.choices[0].message.content
    assert chunks[-1].usage == whole.usage


def test_jpeg_and_text_only_content_lists_on_the_vl_model(env):
    r = post(env, {"messages": image_messages(data_url(png("1", fmt="JPEG"), "image/jpeg"))})
    assert r.status_code == 200, r.text
    text_parts = [{"role": "user", "content": [{"type": "text", "text": "hello"}]}]
    r = post(env, {"messages": text_parts})
    assert r.status_code == 200, r.text


FIELD = "messages[1].content[1].image_url.url"


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("https://example.com/cat.png", "this server fetches nothing; send the image inline"),
        ("http://127.0.0.1/cat.png", "this server fetches nothing"),
        ("file:///etc/passwd", "this server fetches nothing"),
        ("data:image/png;base64,@@not base64@@", "not valid base64"),
        (data_url(b"GIF89a....", "image/gif"), "media type 'image/gif' is not supported"),
        ("data:image/png,rawbytes", "must be a base64 data: URL"),
        ("data:image/png;base64,", "empty"),
        (data_url(b"\x89PNG not really"), "not a decodable png image"),  # the engine's check
        (data_url(png("1", fmt="JPEG")), "declared 'png' but the bytes are jpeg"),
    ],
)
@pytest.mark.parametrize("stream", [False, True])
def test_bad_images_are_400_naming_the_part(env, url, message, stream):
    r = post(env, {"messages": image_messages(url), "stream": stream})
    assert r.status_code == 400, r.text
    err = r.json()["error"]["message"]
    assert err.startswith(FIELD + ":") and message in err, err


@pytest.mark.parametrize(
    ("part", "message"),
    [
        ({"type": "image_url"}, "messages[0].content[1].image_url: required"),
        ({"type": "input_audio", "input_audio": {}}, "messages[0].content[1]: only text and"),
        ({"type": "text"}, "messages[0].content[1].text: required"),
    ],
)
def test_malformed_parts_are_400(env, part, message):
    msgs = [{"role": "user", "content": [{"type": "text", "text": "hi"}, part]}]
    r = post(env, {"messages": msgs})
    assert r.status_code == 400, r.text
    assert message in r.json()["error"]["message"]


def test_image_token_typed_in_text_is_refused(env):
    r = post(env, {"messages": image_messages(data_url(png("1")), text="<|image_pad|>")})
    assert r.status_code == 400, r.text
    assert "rendered 2 image tokens for 1 images" in r.json()["error"]["message"]


def test_caps_are_413_naming_the_part_and_key(env):
    from PIL import Image

    url = data_url(png("1"))
    parts = [{"type": "image_url", "image_url": {"url": url}} for _ in range(MAX_IMAGES + 1)]
    r = post(env, {"messages": [{"role": "user", "content": parts}]})
    assert r.status_code == 413, r.text
    err = r.json()["error"]["message"]
    assert err.startswith(f"messages[0].content[{MAX_IMAGES}].image_url:"), err
    assert "images.max_per_request" in err
    noise = io.BytesIO()
    Image.effect_noise((112, 112), 100).convert("RGB").save(noise, format="PNG")
    assert len(noise.getvalue()) > MAX_BYTES  # noise does not compress
    r = post(env, {"messages": image_messages(data_url(noise.getvalue()))})
    assert r.status_code == 413, r.text
    err = r.json()["error"]["message"]
    assert err.startswith(f"{FIELD}: image of") and "images.max_bytes" in err, err


@pytest.mark.parametrize("stream", [False, True])
def test_a_text_model_refuses_images_and_keeps_serving(env, stream):
    r = post(env, {"model": BASE, "messages": image_messages(data_url(png("1"))), "stream": stream})
    assert r.status_code == 400, r.text
    err = r.json()["error"]["message"]
    assert err.startswith("messages[1].content[1]:") and "text-only" in err, err
    r = post(env, {"model": BASE, "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 200, r.text


def test_the_server_keeps_serving_images_after_errors(env):
    post(env, {"messages": image_messages(data_url(b"\x89PNG not really"))})
    post(env, {"messages": image_messages("https://example.com/x.png")})
    r = post(env, {"messages": image_messages(data_url(png("9")))})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] in ("stop", "length")
