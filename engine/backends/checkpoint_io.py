"""Checkpoint directories of the training backend: atomic writes, manifest, optimizer state.

Owns the on-disk layout next to the PEFT files (``twinkle_state.json``, ``optimizer.pt``,
``manifest.json`` with each file's sha256 and size), writing a directory atomically (temp dir, then
rename; a full disk is a `StorageFullError` naming the folder, the partial directory removed),
verifying a manifest before anything is read, and mapping optimizer state between
parameter indices (torch) and PEFT parameter names (on disk), so a checkpoint does not depend on
the order parameters happen to have in memory.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import asdict, fields
from pathlib import Path
from typing import TYPE_CHECKING

from engine.backends.age_seal import Sealer, plain
from engine.errors import CheckpointError, StorageFullError
from engine.protocol import LoraSpec

if TYPE_CHECKING:  # torch is imported where it is used, so the torch-free mock backend can
    import torch  # share the directory layout (write, manifest, state) with the real one

STATE_FILE = "twinkle_state.json"
OPTIMIZER_FILE = "optimizer.pt"
MANIFEST_FILE = "manifest.json"
CHECKPOINT_FORMAT = 1
REQUIRED_FILES = ("adapter_model.safetensors", "adapter_config.json", STATE_FILE)


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def write_checkpoint_dir(target: Path, fill: Callable[[Path], None]) -> int:
    """Create ``target`` atomically: ``fill(tmp)`` writes the files into a sibling temp dir, then a
    manifest is added and the dir renamed into place. Returns the total bytes written."""
    if target.exists():
        raise CheckpointError(f"checkpoint directory {target} already exists")
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    except OSError as e:
        _raise_if_full(e, target)
        raise
    try:
        try:
            fill(tmp)
        except Exception as e:  # noqa: BLE001 - safetensors / torch wrap ENOSPC in their own types
            _raise_if_full(e, target)
            raise
        files = {
            p.name: {"sha256": sha256(p), "size": p.stat().st_size} for p in sorted(tmp.iterdir())
        }
        manifest = {"format": CHECKPOINT_FORMAT, "files": files}
        try:
            (tmp / MANIFEST_FILE).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
        except OSError as e:
            _raise_if_full(e, target)
            raise
        total = sum(p.stat().st_size for p in tmp.iterdir())
        os.chmod(tmp, 0o755)  # mkdtemp makes it private; samplers may run as another user
        try:
            os.rename(tmp, target)  # atomic: readers see no checkpoint or a complete one
        except OSError:
            raise CheckpointError(f"checkpoint directory {target} already exists") from None
        return total
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)


def _raise_if_full(exc: BaseException, target: Path) -> None:
    """``exc`` as a `StorageFullError` when it means "no space left" (an OSError's errno, or the
    text safetensors' and torch's own errors carry: "os error 28"); else return."""
    text = str(exc)
    if (isinstance(exc, OSError) and exc.errno in _FULL_ERRNOS) or (
        "No space left on device" in text or "os error 28" in text or "Disk quota" in text
    ):
        raise StorageFullError(
            f"checkpoint storage is full: no space left on the disk of {target.parent} while "
            "writing this checkpoint; nothing was saved. Delete checkpoints you no longer need "
            "(or ask the operator for space) and save again"
        ) from None


def write_state(
    directory: Path,
    spec: LoraSpec,
    step: int,
    has_optimizer: bool,
    base: str,
    seal: Sealer = plain,
) -> None:
    """``twinkle_state.json``, through ``seal`` (an encrypted export encrypts it too)."""
    state = {
        "format": CHECKPOINT_FORMAT,
        "spec": asdict(spec),
        "step": step,
        "has_optimizer": bool(has_optimizer),
        "base_model": base,
    }
    name, data = seal(STATE_FILE, (json.dumps(state, indent=2, sort_keys=True) + "\n").encode())
    (directory / name).write_bytes(data)


def verify_manifest(path: Path) -> dict:
    """The manifest's file table, after checking every listed file's size and sha256."""
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {path} not found")
    try:
        manifest = json.loads((path / MANIFEST_FILE).read_text())
        files = manifest["files"]
    except (OSError, ValueError, KeyError, TypeError):
        raise CheckpointError(f"checkpoint {path}: missing or unreadable {MANIFEST_FILE}") from None
    for required in REQUIRED_FILES:
        if required not in files:
            raise CheckpointError(f"checkpoint {path}: manifest does not list {required}")
    for name, meta in files.items():
        f = path / name
        if Path(name).name != name or not f.is_file():
            raise CheckpointError(f"checkpoint {path}: file {name} is missing")
        if f.stat().st_size != meta.get("size") or sha256(f) != meta.get("sha256"):
            raise CheckpointError(
                f"checkpoint {path}: {name} does not match its sha256 in the manifest"
            )
    return files


def read_state(path: Path) -> tuple[LoraSpec, int]:
    """(spec, step) from ``twinkle_state.json``."""
    try:
        state = json.loads((path / STATE_FILE).read_text())
        known = {f.name for f in fields(LoraSpec)}
        spec = LoraSpec(**{k: v for k, v in state["spec"].items() if k in known})
        return spec, int(state["step"])
    except (OSError, ValueError, KeyError, TypeError):
        raise CheckpointError(f"checkpoint {path}: unreadable {STATE_FILE}") from None


def read_optimizer(path: Path, files: dict, device: torch.device) -> dict:
    if OPTIMIZER_FILE not in files:
        raise CheckpointError(f"checkpoint {path} has no optimizer state (saved weights only)")
    import torch

    try:
        return torch.load(path / OPTIMIZER_FILE, map_location=device, weights_only=True)
    except Exception as e:  # noqa: BLE001 - torch.load raises many types on corrupt files
        raise CheckpointError(f"checkpoint {path}: cannot read {OPTIMIZER_FILE}: {e}") from None


def optimizer_state_by_name(names: Sequence[str], optimizer: torch.optim.Optimizer) -> dict:
    """``optimizer.state_dict()`` with parameter indices replaced by PEFT names."""
    sd = optimizer.state_dict()
    return {
        "format": CHECKPOINT_FORMAT,
        "state": {names[i]: v for i, v in sd["state"].items()},
        "param_groups": [
            {**g, "params": [names[i] for i in g["params"]]} for g in sd["param_groups"]
        ],
    }


def optimizer_state_by_index(names: Sequence[str], saved: dict, path: Path) -> dict:
    """The inverse of `optimizer_state_by_name` for an optimizer over ``names`` (in order)."""
    index = {name: i for i, name in enumerate(names)}
    try:
        groups = saved["param_groups"]
        listed = [n for g in groups for n in g["params"]]
        if sorted(listed) != sorted(index) or not set(saved["state"]) <= set(index):
            raise CheckpointError(
                f"{path}: optimizer state does not match the adapter's parameters"
            )
        return {
            "state": {index[n]: v for n, v in saved["state"].items()},
            "param_groups": [{**g, "params": [index[n] for n in g["params"]]} for g in groups],
        }
    except (KeyError, TypeError, AttributeError):
        raise CheckpointError(f"{path}: malformed optimizer state") from None
