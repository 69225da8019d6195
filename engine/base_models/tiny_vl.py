"""Builder of the offline tiny vision-language model (``twinkle/tiny-vl``).

Owns the recipe: the tiny chat model's byte-level BPE tokenizer (tiny.py, same corpus) with
Qwen2-VL's three vision special tokens added, a chat template that renders ``{"type": "image"}``
content parts as ``<|vision_start|><|image_pad|><|vision_end|>``, Qwen2-VL's image processor (the
PIL one: the stock processor class needs torchvision, which we do not install) and a randomly
initialised ``Qwen2VLForConditionalGeneration`` (one vision block, two decoder layers, 0.28 M
parameters). Qwen2-VL rather than upstream's Qwen3.5-VL: the same ``pixel_values`` /
``image_grid_thw`` interface, without Qwen3.5's gated-delta layers, whose torch fallbacks made a
LoRA step 2× slower on CPU (shared/docs/research/cookbook-multimodal-terraform.md §B).

Images: 14-pixel patches merged 2×2, so a 56×56 image is a 4×4 patch grid and 4 ``<|image_pad|>``
tokens; ``max_pixels`` keeps images at most 112×112 (16 tokens) so the tiny model stays fast.
Deterministic and atomic like the text model (tiny.build_atomically). Loads with transformers' own
classes: ``AutoModelForImageTextToText``, ``AutoImageProcessor`` and ``AutoTokenizer`` (not
``AutoProcessor``, which silently returns only the tokenizer without torchvision).
"""

from __future__ import annotations

from pathlib import Path

from engine.base_models.tiny import (
    MAX_POSITIONS,
    SPECIAL_TOKENS,
    _train_tokenizer,
    build_atomically,
)

VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>"]
PATCH_SIZE = 14
MERGE_SIZE = 2
MIN_PIXELS = 28 * 28  # one merged token
MAX_PIXELS = 112 * 112  # 16 merged tokens per image

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' or 'image' in part or 'image_url' in part %}"
    "{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def _tokenizer():
    tok = _train_tokenizer(
        SPECIAL_TOKENS + VISION_TOKENS,
        extra={
            "extra_special_tokens": {
                "image_token": "<|image_pad|>",
                "vision_bos_token": "<|vision_start|>",
                "vision_eos_token": "<|vision_end|>",
            }
        },
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok


def _image_processor():
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    return Qwen2VLImageProcessorPil(
        patch_size=PATCH_SIZE,
        merge_size=MERGE_SIZE,
        temporal_patch_size=2,
        min_pixels=MIN_PIXELS,
        max_pixels=MAX_PIXELS,
    )


def _build_model(tokenizer, seed: int):
    import torch
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS + VISION_TOKENS}
    vocab_size = -(-len(tokenizer) // 64) * 64  # a multiple of 64, like the text model
    text = {
        "vocab_size": vocab_size,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": MAX_POSITIONS,
        # M-RoPE: the 8 rotary frequencies of a 16-wide head split over (time, height, width)
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000.0,
            "mrope_section": [2, 3, 3],
        },
        "bos_token_id": ids["<|endoftext|>"],
        "eos_token_id": ids["<|im_end|>"],
        "pad_token_id": ids["<|pad|>"],
    }
    vision = {
        "depth": 1,
        "embed_dim": 32,
        "hidden_size": 64,  # = the language model's width: the merger projects into it
        "mlp_ratio": 2,
        "num_heads": 2,
        "patch_size": PATCH_SIZE,
        "spatial_merge_size": MERGE_SIZE,
        "temporal_patch_size": 2,
    }
    config = Qwen2VLConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|image_pad|>"],  # no video support: never sent
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=True,
        dtype="float32",
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2VLForConditionalGeneration(config).to(torch.float32)  # pyright: ignore[reportArgumentType]
    return model.eval()


def build_tiny_vl(out_dir: str | Path, seed: int = 0) -> Path:
    """Build the tiny VL model (tokenizer, image processor, weights) into ``out_dir``; a folder
    that already holds a model is left as is."""

    def fill(tmp: Path) -> None:
        tokenizer = _tokenizer()
        model = _build_model(tokenizer, seed)
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        _image_processor().save_pretrained(tmp)

    return build_atomically(out_dir, fill)
