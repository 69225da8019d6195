"""Names of base models the server knows, and where their files live.

Owns the mapping from a configured model name (what clients see as ``base_model``) to a local
HF-format directory, in this order: an explicit ``path``; a built-in tiny model (chat or
vision-language, built on first use under ``<data_dir>/models``); a pulled real model
(``twinkle models pull``, engine/base_models/pull.py); a hub id, ``org/name`` (Hugging Face) or
``ms://org/name`` (ModelScope), from the local cache or downloaded when online
(engine/config/hub.py). Anything else is a ConfigError naming the model and how to get it.
"""

from __future__ import annotations

from pathlib import Path

from engine.config import (
    BUILTIN_MODELS,
    PULLABLE_MODELS,
    TINY_VL_MODEL_NAME,
    is_hub_name,
)
from engine.config.hub import hub_model_dir
from engine.errors import ConfigError

#: name → sub-directory of ``<data_dir>/models`` for models the server can build itself
_BUILDABLE = BUILTIN_MODELS


def known_model_names() -> list[str]:
    """Model names that resolve without an explicit path (besides hub ids)."""
    return sorted([*_BUILDABLE, *PULLABLE_MODELS])


def resolve_model_dir(name: str, data_dir: str | Path, path: str | None = None) -> Path:
    """Local directory of model ``name``.

    An explicit ``path`` wins (it must exist); then the order in the module doc. A built-in
    model is built into ``<data_dir>/models/<subdir>`` if it is not there yet.
    """
    if path is not None:
        p = Path(path).expanduser()
        if not p.is_dir():
            raise ConfigError(
                f"model {name!r}: path {str(p)!r} does not exist or is not a directory"
            )
        return p
    if name in PULLABLE_MODELS:
        from engine.base_models.pull import is_pulled, not_pulled_error, pulled_dir

        if not is_pulled(name, data_dir):
            raise not_pulled_error(name)
        return pulled_dir(name, data_dir)
    if name not in _BUILDABLE:
        if is_hub_name(name) and not name.startswith("twinkle/"):
            return hub_model_dir(name)
        raise ConfigError(
            f"unknown model {name!r} (no path given); known names: "
            f"{', '.join(known_model_names())}, or a hub id (org/name, ms://org/name)"
        )
    out = Path(data_dir) / "models" / _BUILDABLE[name]
    if not (out / "config.json").is_file():
        # heavy imports only when a build is needed
        if name == TINY_VL_MODEL_NAME:
            from engine.base_models.tiny_vl import build_tiny_vl

            build_tiny_vl(out)
        else:
            from engine.base_models.tiny import build_tiny

            build_tiny(out)
    return out
