"""The samplers' cache of adapters loaded from checkpoint directories (LRU, stat-keyed).

Owns the key and the eviction order that the torch and vLLM samplers (and the mock) share: an
entry is keyed by ``(realpath, mtime_ns, size)`` of the directory's ``adapter_model.safetensors``,
so a directory rewritten in place (same path, new file) loads afresh instead of serving stale
weights, and a symlinked path shares the entry of its target. What an entry holds (an internal
adapter id, a vLLM ``LoRARequest``) and how it is loaded or unloaded is the backend's: it passes
``load`` / ``drop`` callables. Imports no torch.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Generic, TypeVar

from engine.errors import CheckpointError

#: the PEFT weights file whose stat keys an entry (= peft_files.ADAPTER_WEIGHTS_NAME)
WEIGHTS_FILE = "adapter_model.safetensors"

V = TypeVar("V")
Key = tuple[str, int, int]


class AdapterDirCache(Generic[V]):
    """Adapter directory → the backend's loaded value, least recently used first."""

    def __init__(self, capacity: int) -> None:
        self.capacity = max(1, int(capacity))
        self._entries: OrderedDict[Key, V] = OrderedDict()
        #: loads from a directory and evictions by `trim` so far (the Sampler's metrics)
        self.loads = 0
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._entries)

    @staticmethod
    def key(adapter_dir: str) -> Key:
        """``(realpath, mtime_ns, size)`` of the weights file; CheckpointError if it is absent."""
        path = os.path.realpath(adapter_dir)
        try:
            st = (Path(path) / WEIGHTS_FILE).stat()
        except OSError:
            raise CheckpointError(f"adapter checkpoint {adapter_dir} not found") from None
        return (path, st.st_mtime_ns, st.st_size)

    def get(
        self,
        adapter_dir: str,
        load: Callable[[str], V],
        drop_stale: Callable[[V], None],
    ) -> V:
        """The cached value for ``adapter_dir`` (now most recently used), or ``load(realpath)``'s,
        which is cached. Entries of the same path with an older stat are removed first and passed
        to ``drop_stale``. A ``load`` that raises caches nothing. Does not evict: call `trim`."""
        key = self.key(adapter_dir)
        if key in self._entries:
            self._entries.move_to_end(key)
            return self._entries[key]
        for stale in [k for k in self._entries if k[0] == key[0]]:
            drop_stale(self._entries.pop(stale))
        value = load(key[0])
        self._entries[key] = value
        self.loads += 1
        return value

    def trim(self, drop: Callable[[V], None], keep: Callable[[V], bool] = lambda v: False) -> None:
        """Evict least recently used entries beyond `capacity`, passing each to ``drop``; entries
        for which ``keep`` is true (in use by the batch being assembled) stay, so the cache may
        remain over capacity until a later trim."""
        excess = len(self._entries) - self.capacity
        for key in list(self._entries):
            if excess <= 0:
                break
            if not keep(self._entries[key]):
                drop(self._entries.pop(key))
                excess -= 1
                self.evictions += 1

    def stats(self) -> dict[str, int]:
        """``loaded`` (entries now), ``loads`` and ``evictions`` so far."""
        return {"loaded": len(self._entries), "loads": self.loads, "evictions": self.evictions}

    def dirs(self) -> list[str]:
        """Cached adapter directories (real paths), least recently used first."""
        return [k[0] for k in self._entries]
