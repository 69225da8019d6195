"""The built-in tiny models, built once per test session and copied into each fresh data dir.

A server or an in-process engine finds a built-in model under ``<data_dir>/models/<subdir>``
(engine/base_models/registry.py) and builds it there when it is missing, which trains a BPE
tokenizer on a 384 KB corpus (~4 s on an idle core, more on a busy one). `seed_models` puts a copy
of the session's build there first, so every fresh data dir starts with the same files at the
cost of a ~2 MB copy. A copy, not a link: a test may write next to or into its model folder.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from engine.config import BUILTIN_MODELS

_root: Path | None = None


def set_root(path: Path) -> None:
    """Build into ``path`` from now on (tests/conftest.py passes a session temp dir)."""
    global _root
    _root = path


def built(name: str) -> Path:
    """The session's build of built-in model ``name`` (built on first use)."""
    global _root
    if _root is None:  # outside pytest (a helper run by hand)
        _root = Path(tempfile.mkdtemp(prefix="twinkle-tiny-models-"))
    from engine.base_models.registry import resolve_model_dir

    return resolve_model_dir(name, _root)  # builds into <_root>/models/<subdir> once


def seed_models(data_dir: Path, names: tuple[str, ...] = tuple(BUILTIN_MODELS)) -> Path:
    """Copy the session's builds of ``names`` into ``data_dir/models`` (those not there yet)."""
    models = Path(data_dir) / "models"
    for name in names:
        dest = models / BUILTIN_MODELS[name]
        if not (dest / "config.json").is_file():
            models.mkdir(parents=True, exist_ok=True)
            shutil.copytree(built(name), dest, dirs_exist_ok=True)
    return models
