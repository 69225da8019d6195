"""Adapter residency: at most `capacity` adapters live in the backend at once; idle ones are
offloaded (LRU) to disk with their optimizer state and step count, and reloaded transparently on
their next use. An adapter is never silently lost or reset.

Runs on the Trainer's compute thread only (no locking). An adapter holding an accumulated,
not-yet-applied gradient is never evicted (its gradient would be lost); if every resident adapter
holds one, the pool goes over capacity rather than lose work, and says so in its stats.
"""

from __future__ import annotations

import logging
import re
import shutil
import uuid
from collections import OrderedDict
from pathlib import Path

from engine.backends.base import TrainingBackend
from engine.errors import AdapterNotFoundError

log = logging.getLogger(__name__)


class AdapterPool:
    def __init__(self, backend: TrainingBackend, capacity: int, offload_dir: str | Path) -> None:
        if capacity < 1:
            raise ValueError("capacity must be ≥ 1")
        self.backend = backend
        self.capacity = capacity
        self.offload_dir = Path(offload_dir)
        self._resident: OrderedDict[str, None] = OrderedDict()  # LRU order, most recent last
        self._offloaded: dict[str, Path] = {}
        self.evictions = 0
        self.reloads = 0
        self.over_capacity = 0

    def __contains__(self, adapter_id: str) -> bool:
        return adapter_id in self._resident or adapter_id in self._offloaded

    def added(self, adapter_id: str) -> None:
        """Record an adapter the backend just created or loaded (it is now resident)."""
        self._resident[adapter_id] = None
        self._resident.move_to_end(adapter_id)
        self._make_room(keep=adapter_id)

    def removed(self, adapter_id: str) -> None:
        self._resident.pop(adapter_id, None)
        path = self._offloaded.pop(adapter_id, None)
        if path is not None:
            shutil.rmtree(path, ignore_errors=True)

    def use(self, adapter_id: str) -> None:
        """Make the adapter resident (reloading it if offloaded) and mark it most recently used."""
        if adapter_id in self._resident:
            self._resident.move_to_end(adapter_id)
            return
        path = self._offloaded.get(adapter_id)
        if path is None:
            if self.backend.has_adapter(adapter_id):  # created outside the pool
                self.added(adapter_id)
                return
            raise AdapterNotFoundError(  # e.g. its Trainer replica restarted (state in memory)
                f"model_id: adapter {adapter_id!r} is not loaded (its Trainer replica may have "
                "restarted): load your last checkpoint (create_training_client_from_state / "
                "load_state) and resubmit from there"
            )
        self._make_room(keep=adapter_id, incoming=1)
        self.backend.load_state(adapter_id, str(path), include_optimizer=True)
        del self._offloaded[adapter_id]
        shutil.rmtree(path, ignore_errors=True)
        self._resident[adapter_id] = None
        self.reloads += 1

    def _make_room(self, keep: str, incoming: int = 0) -> None:
        while len(self._resident) + incoming > self.capacity:
            victim = next((a for a in self._resident if a != keep and not self._pending(a)), None)
            if victim is None:
                self.over_capacity += 1
                log.warning(
                    "adapter pool over capacity (%d): every adapter holds a gradient", self.capacity
                )
                return
            self._evict(victim)

    def _pending(self, adapter_id: str) -> bool:
        return bool(self.backend.has_pending_grad(adapter_id))

    def _evict(self, adapter_id: str) -> None:
        safe = re.sub(r"[^A-Za-z0-9._-]", "_", adapter_id)
        path = self.offload_dir / f"{safe}-{uuid.uuid4().hex[:8]}"
        path.parent.mkdir(parents=True, exist_ok=True)
        self.backend.save_state(adapter_id, str(path), include_optimizer=True)
        self.backend.delete_adapter(adapter_id)
        del self._resident[adapter_id]
        self._offloaded[adapter_id] = path
        self.evictions += 1
        log.info("offloaded adapter %s to %s", adapter_id, path)

    def states(self) -> dict[str, str]:
        """Every adapter this pool holds: ``loaded`` (resident in the backend) or ``offloaded``
        (on disk until its next use)."""
        out = dict.fromkeys(list(self._resident), "loaded")
        out.update(dict.fromkeys(list(self._offloaded), "offloaded"))
        return out

    def stats(self) -> dict[str, int]:
        return {
            "resident": len(self._resident),
            "offloaded": len(self._offloaded),
            "capacity": self.capacity,
            "evictions": self.evictions,
            "reloads": self.reloads,
            "over_capacity_events": self.over_capacity,
        }
