"""Images in the torch sampler (VL models): greedy decoding from an image prompt equals
transformers' own ``generate`` on the same inputs (its M-RoPE bookkeeping against ours), a batch
mixing image and text prompts equals each alone, and bad image prompts fail alone with the field
named."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from engine.backends.sample_torch import TorchSamplingBackend
from engine.errors import UserInputError
from engine.protocol import ImagePart, SampleInput, SamplingParams
from tests.factories import png

pytest.importorskip("PIL")


@pytest.fixture(scope="module")
def sampler(tiny_vl_model_dir: Path) -> TorchSamplingBackend:
    return TorchSamplingBackend(str(tiny_vl_model_dir))


def _prompt(sampler, text: str, image: bytes, size_tokens: int | None = None) -> SampleInput:
    tok = sampler.tokenizer
    before = tok.encode("<|im_start|>user\n<|vision_start|>", add_special_tokens=False)
    after = tok.encode(
        f"<|vision_end|>{text}<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False
    )
    part = ImagePart(image, "png", len(before), size_tokens, chunk_index=1)
    return SampleInput(
        prompt_tokens=before + after,
        prompt_images=[part],
        params=SamplingParams(max_tokens=12, temperature=0.0, stop_at_eos=False),
    )


def _hf_greedy(sampler, inp: SampleInput, n: int) -> list[int]:
    assert sampler.vision is not None
    ids, vis = sampler.vision.expand(inp.prompt_tokens, inp.prompt_images, "prompt")
    x = torch.tensor([ids])
    out = sampler.model.generate(
        input_ids=x,
        attention_mask=torch.ones_like(x),
        pixel_values=torch.from_numpy(vis.pixel_values),
        image_grid_thw=torch.from_numpy(vis.grid_thw),
        mm_token_type_ids=(x == sampler.vision.image_token_id).long(),
        max_new_tokens=n,
        min_new_tokens=n,
        do_sample=False,
    )
    return out[0, len(ids) :].tolist()


def test_greedy_from_an_image_equals_transformers_generate(sampler):
    for text, img in (("read", png("42")), ("what is it", png("x+y", (100, 70)))):
        inp = _prompt(sampler, text, img)
        got = sampler.sample(inp).sequences[0].tokens
        assert got == _hf_greedy(sampler, inp, 12)


def test_image_and_text_prompts_in_one_batch_equal_each_alone(sampler):
    tok = sampler.tokenizer
    text_only = SampleInput(
        prompt_tokens=tok.encode("<|im_start|>user\nhello<|im_end|>\n", add_special_tokens=False),
        num_samples=2,
        params=SamplingParams(max_tokens=10, temperature=0.8, seed=3, stop_at_eos=False),
    )
    img_a = _prompt(sampler, "read", png("12"))
    img_b = _prompt(sampler, "read", png("3+4", (100, 70)))
    img_b.num_samples = 2
    img_b.params = SamplingParams(max_tokens=8, temperature=1.0, seed=5, stop_at_eos=False)
    alone = [sampler.sample(x) for x in (img_a, text_only, img_b)]
    together = sampler.sample_many([img_a, text_only, img_b])
    for a, b in zip(alone, together, strict=True):
        assert not isinstance(b, Exception)
        assert [s.tokens for s in a.sequences] == [s.tokens for s in b.sequences]
        for sa, sb in zip(a.sequences, b.sequences, strict=True):
            np.testing.assert_allclose(sa.logprobs, sb.logprobs, atol=1e-5)
    # the image is seen: another image, another greedy answer or other logprobs
    other = sampler.sample(_prompt(sampler, "read", png("97")))
    first = alone[0].sequences[0]
    assert other.sequences[0].tokens != first.tokens or not np.allclose(
        other.sequences[0].logprobs, first.logprobs, atol=1e-4
    )


def test_bad_image_prompt_fails_alone_naming_the_field(sampler):
    good = _prompt(sampler, "read", png("1"))
    bad = _prompt(sampler, "read", png("1"), size_tokens=7)
    out = sampler.sample_many([good, bad])
    assert not isinstance(out[0], Exception)
    assert isinstance(out[1], UserInputError)
    assert "prompt.chunks[1].expected_tokens: 7, but this server's image processor makes 4" in str(
        out[1]
    )


def test_a_text_model_refuses_image_prompts(tiny_model_dir):
    text_sampler = TorchSamplingBackend(str(tiny_model_dir))
    inp = SampleInput(
        prompt_tokens=[1, 2, 3], prompt_images=[ImagePart(png("1"), "png", 1, chunk_index=1)]
    )
    with pytest.raises(UserInputError, match="prompt.chunks: image chunks: this base model is"):
        text_sampler.sample(inp)
