"""Turning the client's arguments into JSON: numpy arrays and tensors become lists, pydantic
objects their dicts, a `peft.LoraConfig` (or a dict) the JSON string upstream's client sends,
classes and instances their names (losses, optimizers, templates are chosen by name on the
server), images (encoded bytes or a PIL image, e.g. in a message's ``images``) ``data:`` URLs.
Callables cannot travel."""

from __future__ import annotations

import base64
import enum
import io
import json
import math
from collections.abc import Mapping
from typing import Any

from twinkle_client._client import InvalidRequestError


def name_of(obj: Any, what: str) -> str:
    """The name the server knows ``obj`` by: a string as is, a class's name, an instance's class
    name (or its ``name`` attribute for the client's own Template)."""
    if isinstance(obj, str):
        return obj
    if isinstance(obj, type):
        return obj.__name__
    if callable(obj) and not hasattr(obj, "__dict__"):
        raise InvalidRequestError(f"{what}: a function cannot be sent to the server; give a name")
    return getattr(obj, "template_name", None) or type(obj).__name__


def lora_config_dict(config: Any) -> Any:
    """A LoRA config as a JSON-ready dict: a dict as is, a `peft.LoraConfig` its public
    attributes (those JSON can carry, as upstream's client does); a string or None unchanged."""
    if isinstance(config, (str, Mapping)) or config is None:
        return to_wire(config)
    if hasattr(config, "__dict__"):
        out = {}
        for k, v in vars(config).items():
            if k.startswith("_"):
                continue
            try:
                out[k] = to_wire(v)
            except InvalidRequestError:  # upstream drops what JSON cannot carry
                continue
        return out
    raise InvalidRequestError(f"config: {type(config).__name__} is not a LoRA config")


def lora_config_json(config: Any) -> str | None:
    """``add_adapter_to_model``'s ``config``: a JSON string of the config dict (a
    `peft.LoraConfig` gets upstream's ``_TWINKLE_TYPE_`` marker); a string is passed as is,
    None means full-parameter training."""
    if config is None or isinstance(config, str):
        return config
    data = lora_config_dict(config)
    if not isinstance(config, Mapping):
        data["_TWINKLE_TYPE_"] = "LoraConfig"
    return json.dumps(data, ensure_ascii=False)


_MAGIC = ((b"\x89PNG\r\n\x1a\n", "image/png"), (b"\xff\xd8\xff", "image/jpeg"))


def _is_pil_image(value: Any) -> bool:
    return type(value).__module__.startswith("PIL.") and hasattr(value, "save")


def image_data_url(image: Any) -> str:
    """An image as the ``data:image/png|jpeg;base64,...`` URL the server takes: PNG or JPEG
    bytes as they are, a PIL image encoded as PNG (no other formats: 400 here)."""
    if _is_pil_image(image):
        buf = io.BytesIO()
        image.save(buf, format="PNG")
        image = buf.getvalue()
    data = bytes(image)
    media = next((m for magic, m in _MAGIC if data.startswith(magic)), None)
    if media is None:
        raise InvalidRequestError("image: send PNG or JPEG bytes (or a PIL image)")
    return f"data:{media};base64,{base64.b64encode(data).decode()}"


def to_wire(value: Any) -> Any:
    """JSON-ready copy of ``value`` (see module doc)."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, enum.Enum):
        return to_wire(value.value)
    if isinstance(value, Mapping):
        return {str(k): to_wire(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        seq = sorted(value, key=str) if isinstance(value, (set, frozenset)) else value
        return [to_wire(v) for v in seq]
    if isinstance(value, (bytes, bytearray)) or _is_pil_image(value):
        return image_data_url(value)
    if hasattr(value, "model_dump"):  # pydantic objects (e.g. a forward_only response)
        return to_wire(value.model_dump())
    if hasattr(value, "detach"):  # torch.Tensor, without importing torch
        value = value.detach().cpu().numpy()
    if hasattr(value, "tolist"):  # numpy arrays and scalars
        return value.tolist()
    if callable(value):
        raise InvalidRequestError(
            f"{getattr(value, '__name__', value)!r}: functions cannot be sent to the server"
        )
    raise InvalidRequestError(f"cannot send a {type(value).__name__} to the server")
