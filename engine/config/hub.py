"""Models named by hub id: ``org/name`` on the Hugging Face hub, ``ms://org/name`` on ModelScope.

Owns finding such a model's folder: in the local cache first, then downloaded when the process
may go online, else a ConfigError naming the model and how to get it. Torch-free, so the gateway
finds tokenizer files with it (`ModelConfig.files_dir`). The name rule itself (`is_hub_name`) is
in engine/config, which validates model names without loading this module.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

from engine.config import MODELSCOPE_PREFIX, is_hub_name
from engine.errors import ConfigError

_TRUE = ("1", "true", "yes", "on")


def offline() -> bool:
    return any(
        os.environ.get(v, "").strip().lower() in _TRUE
        for v in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
    )


def _how_to_get(name: str) -> str:
    repo = name.removeprefix(MODELSCOPE_PREFIX)
    if name.startswith(MODELSCOPE_PREFIX):
        return (
            f"download it on a machine with network (`modelscope download --model {repo}`) into "
            "this machine's ModelScope cache, or give the model a local 'path:'"
        )
    return (
        f"download it where the hub is reachable (`hf download {repo}`) into this machine's "
        "Hugging Face cache (HF_HUB_CACHE), unset HF_HUB_OFFLINE to let the server download it, "
        "or give the model a local 'path:'"
    )


def _check_folder(name: str, folder: Path) -> Path:
    if not (folder / "config.json").is_file():
        raise ConfigError(f"model {name!r}: {folder} has no config.json (not a model folder)")
    return folder


@functools.cache
def cached_dir(name: str) -> Path:
    """The model's folder in the local cache, without any network; ConfigError if absent.
    Remembered per name (the gateway asks on every encode; `twinkle serve` resolved it before
    any replica started, and a failure is not remembered)."""
    return _resolve(name, local_only=True)


def hub_model_dir(name: str) -> Path:
    """The model's folder: the cache, else a download unless offline; ConfigError otherwise."""
    return _resolve(name, local_only=offline())


def _resolve(name: str, local_only: bool) -> Path:
    if not is_hub_name(name):
        raise ConfigError(f"model {name!r} is not a hub id (org/name or ms://org/name)")
    repo = name.removeprefix(MODELSCOPE_PREFIX)
    if name.startswith(MODELSCOPE_PREFIX):
        try:
            from modelscope import snapshot_download as ms_download  # pyright: ignore
        except ImportError:
            raise ConfigError(
                f"model {name!r}: ModelScope ids need the 'modelscope' package "
                "(pip install modelscope), or give the model a local 'path:'"
            ) from None
        try:
            kw = {"local_files_only": True} if local_only else {}
            return _check_folder(name, Path(ms_download(repo, **kw)))
        except ConfigError:
            raise
        except Exception as e:  # modelscope raises its own errors for missing models
            raise ConfigError(
                f"model {name!r} is not available ({type(e).__name__}); {_how_to_get(name)}"
            ) from None
    from huggingface_hub import snapshot_download  # no torch: the gateway may call this
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    try:
        folder = snapshot_download(repo, local_files_only=local_only)
    except LocalEntryNotFoundError:
        where = "in the local Hugging Face cache" + (" (offline)" if local_only else "")
        raise ConfigError(f"model {name!r} is not {where}; {_how_to_get(name)}") from None
    except (HfHubHTTPError, OSError) as e:
        raise ConfigError(
            f"model {name!r} could not be downloaded ({type(e).__name__}: {e}); {_how_to_get(name)}"
        ) from None
    return _check_folder(name, Path(folder))
