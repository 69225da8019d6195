"""Checkpoint storage that every engine replica reaches: the interface and its shared-directory
default.

Checkpoints and exports are directories the gateway names (``<data_dir>/checkpoints/...``). A
Trainer writes them; a Trainer or Sampler on any node of the cluster reads them, so every replica
must reach the same storage. `CheckpointStorage` is that seam: replicas read a checkpoint through
`readable` (a local directory holding its files) and write one inside `writable` (a local
directory that becomes the checkpoint when the block exits). `SharedDirStorage`, the default, is a
directory every node mounts at the same path (NFS, a cloud file share, or one machine's disk), so
both are the directory itself. An object store would implement the same methods by downloading
into a node-local cache and uploading on exit; none is built yet.

A "shared" directory that is not shared is the classic multi-node mistake: node B starts with its
own empty data dir and every load fails later as "not found". So the driver writes a random
storage id into ``<data_dir>/.twinkle-storage-id`` (`ensure_id`, from `engine.app.engine_apps`)
and each replica checks it when it starts (`check`), failing at once with its node and directory
named.
"""

from __future__ import annotations

import contextlib
import os
import socket
import uuid
from abc import ABC, abstractmethod
from collections.abc import Iterator
from pathlib import Path

from engine.errors import StorageUnreachableError

ID_FILE = ".twinkle-storage-id"


class CheckpointStorage(ABC):
    """Where checkpoint directories live, as every replica of the cluster sees them."""

    @abstractmethod
    def check(self, expected_id: str) -> None:
        """Raise `StorageUnreachableError` unless this node reaches the storage whose id the driver
        wrote (``expected_id``)."""

    @abstractmethod
    def readable(self, location: str) -> Path:
        """A local directory holding the checkpoint at ``location`` (fetched if remote)."""

    @abstractmethod
    def writable(self, location: str) -> contextlib.AbstractContextManager[Path]:
        """A local directory to write the checkpoint at ``location`` into; it is published when
        the block exits without an error."""


class SharedDirStorage(CheckpointStorage):
    """A directory mounted at the same path on every node (the default: the data dir)."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)

    def ensure_id(self) -> str:
        """The storage id, written once (``<root>/.twinkle-storage-id``); kept across restarts so
        replicas of a running cluster and the next deploy agree."""
        path = self.root / ID_FILE
        with contextlib.suppress(FileNotFoundError):
            text = path.read_text().strip()
            if text:
                return text
        self.root.mkdir(parents=True, exist_ok=True)
        new = uuid.uuid4().hex
        tmp = path.with_name(f"{ID_FILE}.{os.getpid()}.tmp")
        tmp.write_text(new + "\n")
        os.replace(tmp, path)  # atomic: a concurrent reader sees no id or the whole one
        return path.read_text().strip()

    def check(self, expected_id: str) -> None:
        path = self.root / ID_FILE
        try:
            found = path.read_text().strip()
        except OSError as e:
            found = f"unreadable ({e.strerror or e})"
        if found != expected_id:
            raise StorageUnreachableError(
                f"node {socket.gethostname()} does not reach the server's checkpoint storage: "
                f"{path} holds {found!r}, not the storage id {expected_id!r} the server wrote. "
                f"Every node of the Ray cluster must mount the same shared directory at "
                f"{self.root} (TWINKLE_DATA_DIR), or checkpoints saved on one node cannot load "
                "on another"
            )

    def readable(self, location: str) -> Path:
        return Path(location)

    @contextlib.contextmanager
    def writable(self, location: str) -> Iterator[Path]:
        yield Path(location)  # the backend writes it atomically in place (checkpoint_io.py)
