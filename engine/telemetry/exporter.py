"""How Prometheus finds a replica's metrics: one HTTP endpoint per replica, one target file each.

Each Trainer / Sampler replica serves its own registry on an ephemeral port (prometheus_client's
threaded WSGI server: scrapes cost the replica nothing between them) and writes
``<data_dir>/metrics/targets/<replica>.json``, a Prometheus ``file_sd`` target list naming that
address. The shipped Prometheus config (infra/observability/prometheus.yml) reads the folder, so
replicas that start, move or restart are picked up within the file_sd refresh without any
Prometheus change. Why this and not Ray's metrics export: infra/observability/README.md.

The file is named after the replica's deployment (``trainer-<model>-r1``), not its process, so a
replica that Ray Serve restarts overwrites its own entry instead of leaving a dead target behind;
a clean shutdown removes it, and `twinkle serve` clears the folder before it starts replicas.
With several nodes, the data dir is shared storage already (checkpoints live there) and ``host``
is ``0.0.0.0``: the file then names the node's IP address as Ray sees it.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, start_http_server

from engine.telemetry.metrics import ReplicaMetrics

log = logging.getLogger(__name__)

#: under the data dir: one ``<replica>.json`` per live replica
TARGETS_SUBDIR = Path("metrics") / "targets"


def targets_dir(data_dir: str | Path) -> Path:
    return Path(data_dir) / TARGETS_SUBDIR


def clear_targets(data_dir: str | Path) -> None:
    """Forget every replica's target (before a new set of replicas starts: a replica killed
    without a clean shutdown leaves its file behind)."""
    shutil.rmtree(targets_dir(data_dir), ignore_errors=True)


def _advertised(host: str, port: int) -> str:
    if host in ("0.0.0.0", "::", ""):
        try:
            import ray

            host = ray.util.get_node_ip_address()
        except Exception:  # noqa: BLE001 - not under Ray: a plain host name is the best guess
            import socket

            host = socket.gethostname()
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class MetricsExporter:
    """Serves ``registry`` at ``http://<host>:<ephemeral port>/metrics`` and lists that address
    in ``<data_dir>/metrics/targets/<replica>.json`` until `close`."""

    def __init__(
        self, registry: CollectorRegistry, data_dir: str | Path, replica: str, host: str
    ) -> None:
        self._server, self._thread = start_http_server(0, addr=host, registry=registry)
        self.port = int(self._server.server_address[1])
        self.address = _advertised(host, self.port)
        safe = re.sub(r"[^A-Za-z0-9._-]", "_", replica)
        self.target_file = targets_dir(data_dir) / f"{safe}.json"
        self._write([{"targets": [self.address], "labels": {}}])
        log.info("metrics of %s at http://%s/metrics", replica, self.address)

    def _write(self, body: list[dict[str, Any]]) -> None:
        # Prometheus may read the file at any moment: write a temp file, then rename over.
        self.target_file.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.target_file.with_name(f".{self.target_file.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(body))
        os.replace(tmp, self.target_file)

    def close(self) -> None:
        """Stop serving and remove the target file, unless a newer replica of the same name
        already wrote its own address there (a restart racing this shutdown)."""
        try:
            if json.loads(self.target_file.read_text())[0]["targets"] == [self.address]:
                self.target_file.unlink()
        except (OSError, ValueError, LookupError):
            pass
        self._server.shutdown()
        self._server.server_close()


class ServesMetrics:
    """A replica (Trainer, Sampler) that may serve its metrics: its endpoint and target file go
    when the replica does (Ray Serve drops the replica object when it shuts the replica down)."""

    _exporter: MetricsExporter | None = None

    def _close_exporter(self) -> None:
        """Stop serving metrics (idempotent)."""
        exporter, self._exporter = self._exporter, None
        if exporter is not None:
            exporter.close()

    def __del__(self) -> None:
        self._close_exporter()


def export_replica_metrics(
    role: str, model: str, data_dir: str | Path, options: dict, state
) -> tuple[ReplicaMetrics, MetricsExporter | None]:
    """A replica's `ReplicaMetrics` and, with ``options["export"]`` (the default), its endpoint
    and target file. ``options``: ``replica`` (the deployment name, the ``replica`` label and
    the target file's name), ``host`` (the address to bind) and ``export``."""
    metrics = ReplicaMetrics(role, model, options["replica"], state)
    exporter = None
    if options.get("export", True):
        exporter = MetricsExporter(
            metrics.registry, data_dir, options["replica"], options.get("host", "127.0.0.1")
        )
    return metrics, exporter
