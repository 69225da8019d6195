"""Images at the gateway: the caps checked before any work (per base model, `ImageLimits` in the
server config): images per request and encoded bytes per image → 413 naming the field, the cap
and its config key; reading a JSON image chunk (base64 ``data``) and a ``data:`` URL
(the OpenAI API's and the native template's images). The gateway never decodes
an image: pixels, formats and token counts are the engine's (engine/backends/vision.py)."""

from __future__ import annotations

import base64
import binascii
from collections.abc import Sequence

from engine.config import ImageLimits
from engine.protocol import ImagePart
from gateway.errors import InvalidRequestError, PayloadTooLargeError

#: data: URL media types → the engine's image formats
_IMAGE_TYPES = {"image/png": "png", "image/jpeg": "jpeg", "image/jpg": "jpeg"}


def check_images(parts: Sequence[tuple[str, ImagePart]], limits: ImageLimits) -> None:
    """``parts``: (field name, image) of every image in one request."""
    if len(parts) > limits.max_per_request:
        raise PayloadTooLargeError(
            f"{parts[limits.max_per_request][0]}: {len(parts)} images in one request; this "
            f"server takes at most {limits.max_per_request} (images.max_per_request)"
        )
    for where, part in parts:
        if len(part.data) > limits.max_bytes:
            raise PayloadTooLargeError(
                f"{where}.data: image of {len(part.data)} bytes; this server takes at most "
                f"{limits.max_bytes} bytes per image (images.max_bytes)"
            )


def json_image_chunk(chunk: dict, where: str) -> tuple[bytes, str, int | None]:
    """``(bytes, format, expected_tokens)`` of a JSON image chunk (``data`` base64, as the SDK's
    asample and older SDKs send it); 400 naming the field otherwise."""
    raw = chunk.get("data")
    fmt = chunk.get("format")
    expected = chunk.get("expected_tokens")
    if not isinstance(raw, str):
        raise InvalidRequestError(f"{where}.data: must be the image's bytes in base64")
    try:
        data = base64.b64decode(raw, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidRequestError(f"{where}.data: not valid base64") from None
    if not isinstance(fmt, str):
        raise InvalidRequestError(f"{where}.format: required (png or jpeg)")
    if expected is not None and (
        isinstance(expected, bool) or not isinstance(expected, int) or expected < 1
    ):
        raise InvalidRequestError(f"{where}.expected_tokens: must be an integer ≥ 1")
    return data, fmt, expected


def data_url_image(url: str, where: str) -> tuple[bytes, str]:
    """``(bytes, format)`` of a ``data:image/png|jpeg;base64,…`` URL; 400 naming ``where``."""
    head, comma, payload = url.partition(",")
    if head[:5].lower() != "data:":
        raise InvalidRequestError(
            f"{where}: only data: URLs are accepted: this server fetches nothing; send the "
            "image inline as a data: URL (data:image/png;base64,...)"
        )
    media, *params = head[5:].split(";")
    media = media.strip().lower()
    fmt = _IMAGE_TYPES.get(media)
    if fmt is None:
        raise InvalidRequestError(
            f"{where}: media type {media!r} is not supported; send image/png or image/jpeg"
        )
    if not comma or "base64" not in (p.strip().lower() for p in params):
        raise InvalidRequestError(f"{where}: must be a base64 data: URL (data:{media};base64,...)")
    try:
        data = base64.b64decode(payload.strip(), validate=True)
    except (binascii.Error, ValueError):
        raise InvalidRequestError(f"{where}: the image data is not valid base64") from None
    if not data:
        raise InvalidRequestError(f"{where}: the image data is empty")
    return data, fmt
