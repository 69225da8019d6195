"""Turning the client's arguments into JSON: numpy arrays and tensors become lists, a
`peft.LoraConfig` (or any object with ``to_dict``) a dict, classes and instances their names
(losses, optimizers, templates are chosen by name on the server). Callables cannot travel."""

from __future__ import annotations

import enum
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
    if isinstance(config, (str, Mapping)) or config is None:
        return to_wire(config)
    if hasattr(config, "to_dict"):
        return to_wire(config.to_dict())
    if hasattr(config, "__dict__"):
        return to_wire({k: v for k, v in vars(config).items() if not k.startswith("_")})
    raise InvalidRequestError(f"config: {type(config).__name__} is not a LoRA config")


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
    if hasattr(value, "detach"):  # torch.Tensor, without importing torch
        value = value.detach().cpu().numpy()
    if hasattr(value, "tolist"):  # numpy arrays and scalars
        return value.tolist()
    if hasattr(value, "model_dump"):
        return to_wire(value.model_dump())
    if callable(value):
        raise InvalidRequestError(
            f"{getattr(value, '__name__', value)!r}: functions cannot be sent to the server"
        )
    raise InvalidRequestError(f"cannot send a {type(value).__name__} to the server")
