"""Images at the gateway: the caps checked before any work (per base model, `ImageLimits` in the
server config): images per request and encoded bytes per image → 413 naming the field, the cap
and its config key; and reading a JSON image chunk (base64 ``data``). The gateway never decodes
an image: pixels, formats and token counts are the engine's (engine/backends/vision.py)."""

from __future__ import annotations

import base64
import binascii
from collections.abc import Sequence

from engine.config import ImageLimits
from engine.protocol import ImagePart
from gateway.errors import InvalidRequestError, PayloadTooLargeError


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
