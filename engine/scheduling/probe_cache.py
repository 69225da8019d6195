"""The execution probe's answers, kept in the data dir so a restart on the same kind of host
skips the measurement.

Owns `ProbeCache`. `execution: auto` times fused against sequential work at start-up
(engine/scheduling/execution_probe.py): ~15 s of a 25 M model's 25-27 s first start on a 2-core
CPU (benchmarks/README.md). The answer depends only on what the timing ran on, so it is stored under
a key made of everything that can change it: the backend's device fingerprint (device and its
name, threads, dtype, library versions, the model's architecture:
`TrainingBackend.device_fingerprint`), the probe's shape and this module's `PROBE_VERSION`. A
backend that returns no fingerprint is measured on every start.

An entry is trusted for `MAX_AGE_S` (a measurement taken while the host was busy must not decide
for ever); deleting ``<data_dir>/execution-probe/`` measures again on the next start. Entries are
written to a temporary file and renamed, so replicas starting together on a shared data dir never
read half a file; an unreadable or foreign entry is ignored (and measured over), never an error.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import socket
import time
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

#: bump when the probe's method or its choice rule changes, so older answers are not reused
PROBE_VERSION = 1
#: an entry older than this (7 days) is measured again
MAX_AGE_S = 7 * 24 * 3600.0
#: the cache's folder under the data dir
FOLDER = "execution-probe"
#: what an entry's costs must hold to be used (execution_probe.measure_execution_costs returns it)
COST_KEYS = frozenset({"fused_s", "sequential_s", "fused_speedup", "choice"})


class ProbeCache:
    """The stored probe answers under ``<data_dir>/execution-probe/``, one JSON file per key."""

    def __init__(self, data_dir: str | Path, *, max_age_s: float = MAX_AGE_S) -> None:
        self.dir = Path(data_dir) / FOLDER
        self.max_age_s = max_age_s

    @staticmethod
    def key(fingerprint: dict[str, Any], shape: dict[str, Any]) -> dict[str, Any]:
        """Everything the answer depends on, as one JSON-able dict."""
        return {"version": PROBE_VERSION, "device": fingerprint, "shape": shape}

    @staticmethod
    def _canonical(key: dict[str, Any]) -> str:
        return json.dumps(key, sort_keys=True, default=str)

    def path(self, key: dict[str, Any]) -> Path:
        digest = hashlib.sha256(self._canonical(key).encode()).hexdigest()
        return self.dir / f"{digest[:32]}.json"

    def get(self, key: dict[str, Any]) -> dict[str, Any] | None:
        """The stored costs for ``key`` with ``stored: True`` and ``measured_at`` (Unix time)
        added (not the file's path: the Trainer's stats reach the admin API, and server paths
        stay on the server; the log names it); None when absent, too old or unreadable."""
        path = self.path(key)
        try:
            entry = json.loads(path.read_text())
            costs, measured_at = entry["costs"], float(entry["measured_at"])
            # a hash collision or a hand-edited file must not hand out another key's answer
            same = self._canonical(entry["key"]) == self._canonical(key)
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError) as e:
            log.warning("execution probe cache: ignoring unreadable %s (%s)", path, e)
            return None
        if not same or not isinstance(costs, dict) or not costs.keys() >= COST_KEYS:
            log.warning("execution probe cache: ignoring %s (another key or no costs)", path)
            return None
        if costs["choice"] not in ("fused", "sequential"):
            return None
        age = time.time() - measured_at
        if not 0 <= age <= self.max_age_s:
            return None
        log.info("execution probe: using the answer stored in %s", path)
        return {**costs, "stored": True, "measured_at": measured_at}

    def put(self, key: dict[str, Any], costs: dict[str, Any]) -> Path | None:
        """Store ``costs`` for ``key``; returns the file, or None if the data dir refused the
        write (logged: the next start measures again, nothing else is lost)."""
        path = self.path(key)
        entry = {
            "key": key,
            "costs": {k: costs[k] for k in sorted(COST_KEYS)},
            "measured_at": time.time(),
            "host": socket.gethostname(),
        }
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps(entry, indent=1, sort_keys=True, default=str))
            os.replace(tmp, path)
        except OSError as e:
            log.warning("execution probe cache: could not write %s (%s)", path, e)
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)
            return None
        return path
