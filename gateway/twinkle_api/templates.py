"""Chat templates and encoding for the native API: trajectories → input features, and back.

Owns: the template names a client may choose (`TEMPLATES`), their options, how a trajectory
(``{"messages": [{"role", "content"}, ...]}``) becomes ``{"input_ids", "labels"}`` (assistant turns
are trained, everything else has label -100), generation prompts for sampling, decoding, and which
tokenizer files a client may download. Tokenizers are the base model's own ``tokenizer.json``,
loaded once per model with the light `tokenizers` library (no transformers, no torch).

Every model we serve (the tiny model, SmolLM2, Qwen2/2.5/3) speaks ChatML, so every family name
maps onto one ChatML renderer; an unknown name is a 400 that lists the known ones. Each message is
tokenized segment by segment (role header, content, end marker), so labels line up with tokens
exactly.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from engine.protocol import ImagePart
from gateway.errors import InvalidRequestError
from gateway.images import data_url_image

IGNORE_INDEX = -100
#: upstream's image placeholder in message content (its Message carries the images)
IMAGE_PLACEHOLDER = "<image>"
#: how a Qwen2-VL-style chat template renders one image (the middle one is the image token)
VISION_TOKENS = ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>")
#: accepted names (upstream Twinkle's class names and family aliases) → renderer
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
ROLES = {"system", "user", "assistant", "tool"}
#: files a client may fetch to rebuild the tokenizer locally (config.json: AutoTokenizer reads it)
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "config.json",
    "generation_config.json",
    "preprocessor_config.json",  # a VL model's image processor: clients size image chunks by it
)


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


@functools.lru_cache(maxsize=8)
def load_tokenizer(model_dir: str):
    from tokenizers import Tokenizer

    path = Path(model_dir) / "tokenizer.json"
    if not path.is_file():
        raise InvalidRequestError(f"base model at {Path(model_dir).name} has no tokenizer.json")
    return Tokenizer.from_file(str(path))


class ChatEncoder:
    """ChatML encoding with one tokenizer (see module doc)."""

    def __init__(self, tokenizer: Any, options: Mapping[str, Any] | None = None) -> None:
        missing = [t for t in ("<|im_start|>", "<|im_end|>") if tokenizer.token_to_id(t) is None]
        if missing:  # a model outside the ChatML families: refuse rather than mis-encode
            raise InvalidRequestError(
                f"template: this base model's tokenizer has no {', '.join(missing)} token; its "
                "chat format is not supported by the server's templates (send input_ids)"
            )
        self.tok = tokenizer
        self.opts = dict(options or {})
        #: a VL model's image tokens (Qwen2-VL's), or None for a text model
        ids = [tokenizer.token_to_id(t) for t in VISION_TOKENS]
        self.vision_ids: list[int] | None = None if None in ids else ids

    def _ids(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids if text else []

    def _messages(self, item: Mapping[str, Any], field: str) -> list[Mapping[str, Any]]:
        msgs = item.get("messages")
        if not isinstance(msgs, list) or not msgs:
            raise InvalidRequestError(f"{field}.messages: must be a non-empty list of messages")
        for j, m in enumerate(msgs):
            if not isinstance(m, Mapping) or m.get("role") not in ROLES:
                raise InvalidRequestError(
                    f"{field}.messages[{j}].role: must be one of {', '.join(sorted(ROLES))}"
                )
            if not isinstance(m.get("content"), str):
                raise InvalidRequestError(f"{field}.messages[{j}].content: must be a string")
            images = m.get("images") or []
            if not isinstance(images, list):
                raise InvalidRequestError(f"{field}.messages[{j}].images: must be a list")
            n = m["content"].count(IMAGE_PLACEHOLDER)
            if (n or images) and self.vision_ids is None:
                raise InvalidRequestError(
                    f"{field}.messages[{j}].images: this base model is text-only; images need a "
                    "vision-language model"
                )
            if n != len(images):
                raise InvalidRequestError(
                    f"{field}.messages[{j}].images: {len(images)} images for {n} "
                    f"{IMAGE_PLACEHOLDER} placeholders in its content"
                )
        system = self.opts.get("default_system")
        if system and msgs[0].get("role") != "system":
            msgs = [{"role": "system", "content": str(system)}, *msgs]
        return msgs

    def encode(
        self,
        item: Mapping[str, Any],
        *,
        add_generation_prompt: bool = False,
        field: str = "inputs[0]",
    ) -> dict[str, list[int]]:
        """``{"input_ids", "labels"}`` of one trajectory (trained: assistant content + end)."""
        ids: list[int] = []
        labels: list[int] = []
        images: list[str] = []
        for j, m in enumerate(self._messages(item, field)):
            head = self._ids(f"<|im_start|>{m['role']}\n")
            body = self._content_ids(m, f"{field}.messages[{j}]", images)
            body += self._ids("<|im_end|>")
            tail = self._ids("\n")
            trained = m["role"] == "assistant"
            ids += head + body + tail
            labels += [IGNORE_INDEX] * len(head)
            labels += (
                [IGNORE_INDEX if t in (self.vision_ids or ()) else t for t in body]
                if trained
                else [IGNORE_INDEX] * len(body)
            )
            labels += [IGNORE_INDEX] * len(tail)
        if add_generation_prompt:
            gen = self._ids("<|im_start|>assistant\n")
            ids += gen
            labels += [IGNORE_INDEX] * len(gen)
        max_len = self.opts.get("max_length")
        if max_len and len(ids) > max_len:
            if self.opts.get("truncation_strategy", "right") == "left":
                ids, labels = ids[-max_len:], labels[-max_len:]
            else:
                ids, labels = ids[:max_len], labels[:max_len]
        out: dict[str, Any] = {"input_ids": ids, "labels": labels}
        if images:  # data: URLs, one per image token in input_ids (engine/backends/vision.py)
            out["images"] = images
        return out

    def _content_ids(self, m: Mapping[str, Any], where: str, images: list[str]) -> list[int]:
        """A message's content tokens; each ``<image>`` becomes ``<|vision_start|><|image_pad|>
        <|vision_end|>`` (one image token, expanded by the engine) and its image is appended to
        ``images`` as a checked ``data:`` URL."""
        pieces = m["content"].split(IMAGE_PLACEHOLDER)
        out = self._ids(pieces[0])
        for k, piece in enumerate(pieces[1:]):
            ref = m["images"][k]
            if not isinstance(ref, str):
                raise InvalidRequestError(
                    f"{where}.images[{k}]: must be a data:image/png|jpeg;base64 URL (the client "
                    "sends images so)"
                )
            data_url_image(ref, f"{where}.images[{k}]")  # 400 here, not in the engine
            images.append(ref)
            assert self.vision_ids is not None
            out += self.vision_ids + self._ids(piece)
        return out

    def prompt_tokens(self, item: Mapping[str, Any], field: str) -> list[int]:
        """Tokens to sample from: an encoded feature's ``input_ids`` as is, or a trajectory with
        the generation prompt appended."""
        if "input_ids" in item:
            ids = item["input_ids"]
            if (
                not isinstance(ids, list)
                or not ids
                or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids)
            ):
                raise InvalidRequestError(f"{field}.input_ids: must be a non-empty list of ints")
            return list(ids)
        if "messages" not in item:
            raise InvalidRequestError(
                f"{field}: expected a trajectory {{'messages': [...]}} or an encoded feature "
                "{'input_ids': [...]}"
            )
        return self.encode(item, add_generation_prompt=True, field=field)["input_ids"]

    def sample_input_parts(
        self, item: Mapping[str, Any], prompt: list[int], field: str
    ) -> tuple[list[int], list[ImagePart]]:
        """The engine's view of ``prompt`` (`prompt_tokens` of ``item``): the text tokens, and
        one `ImagePart` per image token at its place (the item's ``images``, data: URLs, as
        `encode` wrote them); a text prompt comes back as is, with no images."""
        images = item.get("images")
        if images is None and "messages" in item:
            images = self.encode(item, add_generation_prompt=True, field=field).get("images")
        images = images or []
        image_id = self.vision_ids[1] if self.vision_ids is not None else None
        marks = [i for i, t in enumerate(prompt) if t == image_id]
        if len(marks) != len(images):
            raise InvalidRequestError(
                f"{field}.images: {len(images)} images for {len(marks)} image tokens in the prompt"
            )
        if not images:
            return prompt, []
        text = [t for t in prompt if t != image_id]
        parts = []
        for k, (pos, ref) in enumerate(zip(marks, images, strict=True)):
            if not isinstance(ref, str):
                raise InvalidRequestError(f"{field}.images[{k}]: must be a data: URL")
            data, fmt = data_url_image(ref, f"{field}.images[{k}]")
            parts.append(ImagePart(data, fmt, pos - k, chunk_index=k))
        return text, parts

    def decode(self, tokens: list[int]) -> str:
        return self.tok.decode(tokens, skip_special_tokens=True)
