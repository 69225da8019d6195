"""Images in OpenAI chat messages: ``image_url`` parts with ``data:image/png|jpeg;base64,…`` URLs
(``detail`` ignored; nothing is ever fetched, so any other URL is a 400 naming the part).

Owns turning a chat message into what the model's chat template takes (text parts, and an
``{"type": "image"}`` part per image) plus its decoded images (`ChatImage`: bytes, format, the
message part they came from), the per-model caps (413, `gateway.images`), and renaming the
engine's image error fields (``prompt.chunks[j]``) to the client's
``messages[i].content[k].image_url.url``. The gateway only base64-decodes: pixels, formats and
token counts are the engine's (engine/backends/vision.py).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from engine.config import ImageLimits
from engine.protocol import ImagePart
from gateway.errors import InvalidRequestError, PayloadTooLargeError
from gateway.images import check_images, data_url_image

#: an engine error's name of image j (`ImagePart.chunk_index` = j) and its data / format field
_ENGINE_IMAGE = re.compile(r"prompt\.chunks\[(\d+)\](?:\.(?:data|format))?")


def rename_image_fields(msg: str, image_fields: Sequence[str]) -> str:
    """An engine message with image j's field named ``image_fields[j]``'s URL."""
    if not image_fields:
        return msg

    def url(j: int) -> str:
        return f"{image_fields[min(j, len(image_fields) - 1)]}.image_url.url"

    msg = _ENGINE_IMAGE.sub(lambda m: url(int(m[1])), msg)
    if msg.startswith("prompt.chunks"):
        msg = url(0) + msg[len("prompt.chunks") :]
    return msg


@dataclass(frozen=True)
class ChatImage:
    """An image of a chat request: its message part (``messages[i].content[k]``), bytes, format."""

    field: str
    data: bytes
    format: str


def message_dict(i: int, m) -> tuple[dict, list[ChatImage]]:
    """The message as the chat template takes it, and its images in order. Content without
    images becomes one string (text parts joined), as before images were supported; with
    images, a list of ``{"type": "text", "text"}`` and ``{"type": "image"}`` parts."""
    content = m.content
    images: list[ChatImage] = []
    if isinstance(content, list):
        parts: list[dict] = []
        for k, part in enumerate(content):
            where = f"messages[{i}].content[{k}]"
            if part.type == "text":
                if part.text is None:
                    raise InvalidRequestError(f"{where}.text: required in a text part")
                parts.append({"type": "text", "text": part.text})
            elif part.type == "image_url":
                if part.image_url is None:
                    raise InvalidRequestError(
                        f"{where}.image_url: required in an image_url part "
                        '({"url": "data:image/png;base64,..."})'
                    )
                data, fmt = data_url_image(part.image_url.url, f"{where}.image_url.url")
                images.append(ChatImage(where, data, fmt))
                parts.append({"type": "image"})
            else:
                raise InvalidRequestError(
                    f"{where}: only text and image_url parts are supported, got {part.type!r}"
                )
        content = parts if images else "".join(p["text"] for p in parts)
    if content is None:
        raise InvalidRequestError(f"messages[{i}].content: must be a string or content parts")
    out = {"role": m.role, "content": content}
    if m.name:
        out["name"] = m.name
    return out, images


def check_image_caps(model_cfg, images: list[ChatImage]) -> None:
    """The model's image caps (`gateway.images.check_images`; defaults without a config): 413
    naming the part."""
    limits = model_cfg.images if model_cfg is not None else ImageLimits()
    parts = [
        (f"{img.field}.image_url", ImagePart(img.data, img.format, 0, chunk_index=j))
        for j, img in enumerate(images)
    ]
    try:
        check_images(parts, limits)
    except PayloadTooLargeError as exc:  # check_images names the bytes "<where>.data"
        msg = exc.message.replace(".image_url.data:", ".image_url.url:")
        raise PayloadTooLargeError(msg) from None
