"""The native API's template and processor choices, checked at the edge: the names a client may
send (upstream Twinkle's class names), their options, and the images a trajectory carries.

Owns: `TEMPLATES`, `check_template`, `check_processor`, `checked_images`. Rendering and tokenizing
are the model's own (its chat template, by the Sampler: engine/sampler_text.py), so every family
name selects the same thing, the model's template, and only its options matter; an unknown name is
a 400 that lists the known ones.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gateway.errors import InvalidRequestError
from gateway.images import data_url_image

#: accepted names (upstream Twinkle's class names and family aliases); each renders with the
#: model's own chat template (the models served here, tiny, SmolLM2, Qwen2/2.5/3, speak ChatML)
TEMPLATES = {
    "Template": "chatml",
    "ChatMLTemplate": "chatml",
    "QwenTemplate": "chatml",
    "Qwen2Template": "chatml",
    "Qwen2_5Template": "chatml",
    "Qwen3Template": "chatml",
    "Qwen3_5Template": "chatml",
    "SmolLMTemplate": "chatml",
}
TEMPLATE_OPTIONS = {"max_length", "truncation_strategy", "default_system", "enable_thinking"}
PROCESSORS = {"InputProcessor"}
PROCESSOR_OPTIONS = {"padding_side", "padding_free"}


def check_template(name: Any, kwargs: Mapping[str, Any], field: str = "template") -> str:
    """The template's renderer, or a 400 naming the unknown name / option."""
    if not isinstance(name, str) or name not in TEMPLATES:
        raise InvalidRequestError(
            f"{field}: unknown template {name!r}; known: {', '.join(sorted(TEMPLATES))}"
        )
    bad = sorted(set(kwargs) - TEMPLATE_OPTIONS)
    if bad:
        raise InvalidRequestError(
            f"{field}: unsupported option(s) {', '.join(bad)}; accepted: "
            f"{', '.join(sorted(TEMPLATE_OPTIONS))}"
        )
    ml = kwargs.get("max_length")
    if ml is not None and (isinstance(ml, bool) or not isinstance(ml, int) or ml < 2):
        raise InvalidRequestError(f"{field}.max_length: {ml!r} must be an integer >= 2")
    return TEMPLATES[name]


def check_processor(name: Any, kwargs: Mapping[str, Any]) -> None:
    if not isinstance(name, str) or name not in PROCESSORS:
        raise InvalidRequestError(
            f"processor: unknown processor {name!r}; known: {', '.join(sorted(PROCESSORS))}"
        )
    bad = sorted(set(kwargs) - PROCESSOR_OPTIONS)
    if bad:
        raise InvalidRequestError(f"processor: unsupported option(s) {', '.join(bad)}")


def checked_images(messages: list[dict], field: str) -> list[str]:
    """The images of a trajectory the Sampler has rendered (so their count matches the content's
    ``<image>`` placeholders), in order, each a checked ``data:`` URL (400 naming it)."""
    images: list[str] = []
    for j, m in enumerate(messages):
        for k, ref in enumerate(m.get("images") or []):
            where = f"{field}.messages[{j}].images[{k}]"
            if not isinstance(ref, str):
                raise InvalidRequestError(
                    f"{where}: must be a data:image/png|jpeg;base64 URL (the client sends "
                    "images so)"
                )
            data_url_image(ref, where)  # 400 here, not in the engine
            images.append(ref)
    return images
