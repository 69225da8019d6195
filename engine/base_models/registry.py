"""Names of base models the server knows, and where their files live.

Owns the mapping from a configured model name (what clients see as ``base_model``) to a local
HF-format directory. The tiny offline models (chat and vision-language) are built on first use
under ``<data_dir>/models``.
"""

from __future__ import annotations

from pathlib import Path

from engine.config import BUILTIN_MODELS, TINY_VL_MODEL_NAME
from engine.errors import ConfigError

#: name → sub-directory of ``<data_dir>/models`` for models the server can build itself
_BUILDABLE = BUILTIN_MODELS


def known_model_names() -> list[str]:
    """Model names that resolve without an explicit path."""
    return sorted(_BUILDABLE)


def resolve_model_dir(name: str, data_dir: str | Path, path: str | None = None) -> Path:
    """Local directory of model ``name``.

    An explicit ``path`` wins (it must exist). Otherwise the name must be a known buildable model,
    which is built into ``<data_dir>/models/<subdir>`` if it is not there yet.
    """
    if path is not None:
        p = Path(path).expanduser()
        if not p.is_dir():
            raise ConfigError(
                f"model {name!r}: path {str(p)!r} does not exist or is not a directory"
            )
        return p
    if name not in _BUILDABLE:
        raise ConfigError(
            f"unknown model {name!r} (no path given); known names: {', '.join(known_model_names())}"
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
