"""A two-node Ray cluster on this host, for the multi-node e2e test: a head (`ray start --head
--block`) and a worker node (tests/e2e/ray_worker_node.py), each a separate process in its own
session; loopback only, no usage stats, private temp dirs, no token auth and explicit free
ports (Ray's defaults are fixed ports such as 6379, 10001 and 52365 that another Ray on the host
may hold).

Stopping a node kills its process group (its raylet, object store, agents and workers): that is
how a node dies. `close` kills every process either node started.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

from tests.launch import count_ray_cluster

REPO = Path(__file__).resolve().parents[2]
RAY = str(Path(sys.executable).parent / "ray")
#: small object stores: two nodes share this host's memory with the rest of the suite
OBJECT_STORE_BYTES = 100 * 1024 * 1024


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def auth_env() -> dict[str, str]:
    """What a process needs to join the cluster (`twinkle serve` gets it too). Ray 2.60 turns
    token auth on by itself when ~/.ray/auth_token exists (another Ray on the host may have made
    one), and a process reads the mode once, at import: the test process, which queries the state
    API, would need it before Ray is imported. Auth stays off explicitly: every socket is
    loopback."""
    return {"RAY_AUTH_MODE": "disabled"}


class TwoNodeCluster:
    """``head`` (``head_cpus`` CPUs) and ``worker`` (``worker_cpus`` CPUs and ``resources``)."""

    def __init__(self, head_cpus: int, worker_cpus: int, resources: dict[str, float]) -> None:
        # short: Ray's unix sockets live under it (108-byte path limit)
        self.root = Path(tempfile.mkdtemp(prefix="twr", dir="/tmp"))
        self.head_cpus, self.worker_cpus, self.resources = head_cpus, worker_cpus, resources
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.dashboard_port = free_port()
        self.dashboard = f"http://127.0.0.1:{self.dashboard_port}"
        self.head: subprocess.Popen | None = None
        self.worker: subprocess.Popen | None = None
        self._logs: list = []
        self.env = auth_env()
        self.restarts = 0

    def _popen(self, name: str, cmd: list[str]) -> subprocess.Popen:
        log = open(self.root / f"{name}.log", "a")  # noqa: SIM115 (open until close())
        self._logs.append(log)
        # loopback only with RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 (environment.md §6)
        env = dict(
            os.environ,
            RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0",
            RAY_USAGE_STATS_ENABLED="0",
            # a loaded 2-core host: the raylet waits this long for its agents to start
            RAY_agent_register_timeout_ms="120000",
        )
        return subprocess.Popen(
            cmd,
            env={**env, **self.env},
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=REPO,
            start_new_session=True,
        )

    def start_head(self) -> None:
        count_ray_cluster()
        args = ["--head", "--block", "--disable-usage-stats", "--node-ip-address", "127.0.0.1"]
        args += ["--port", str(self.port), "--num-cpus", str(self.head_cpus)]
        args += ["--object-store-memory", str(OBJECT_STORE_BYTES)]
        # the dashboard serves Ray's state API (which node an actor runs on), loopback only
        args += ["--temp-dir", str(self.root / "head"), "--include-dashboard", "true"]
        args += ["--dashboard-host", "127.0.0.1", "--dashboard-port", str(self.dashboard_port)]
        args += ["--ray-client-server-port", str(free_port())]
        for flag in (
            "--node-manager-port",
            "--object-manager-port",
            "--dashboard-agent-listen-port",
            "--dashboard-agent-grpc-port",
            "--metrics-export-port",
            "--runtime-env-agent-port",
        ):
            args += [flag, str(free_port())]
        self.head = self._popen("head", [RAY, "start", *args])

    def start_worker(self) -> None:
        spec = {
            "address": self.address,
            "num_cpus": self.worker_cpus,
            "resources": self.resources,
            "object_store_memory": OBJECT_STORE_BYTES,
            "temp_dir": str(self.root / "worker"),
            "ports": {
                k: free_port()
                for k in (
                    "node_manager_port",
                    "object_manager_port",
                    "dashboard_agent_listen_port",
                    "metrics_agent_port",
                    "metrics_export_port",
                    "runtime_env_agent_port",
                )
            },
        }
        cmd = [sys.executable, "-m", "tests.e2e.ray_worker_node", json.dumps(spec)]
        self.worker = self._popen("worker", cmd)

    def revive(self) -> None:
        """Start again a node whose start-up failed. On a loaded host (load 25 on 2 cores while
        other suites run) a node can miss Ray's fixed 30 s start-up window (ray/_private/node.py)
        and exit; a second try usually makes it."""
        if self.head is not None and self.head.poll() is not None:
            self.restarts += 1
            self.start_head()
        if self.worker is not None and self.worker.poll() is not None:
            self.restarts += 1
            self.start_worker()
        if self.restarts > 4:
            raise RuntimeError(f"Ray nodes keep failing to start:\n{self.log('head')}")

    @staticmethod
    def _kill(proc: subprocess.Popen | None) -> None:
        if proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=10)

    def stop_worker(self) -> None:
        """The worker node dies: its whole process group is killed."""
        self._kill(self.worker)
        self.worker = None

    def log(self, name: str) -> str:
        path = self.root / f"{name}.log"
        return path.read_text()[-3000:] if path.exists() else ""

    def close(self) -> None:
        self._kill(self.worker)
        self._kill(self.head)
        for log in self._logs:
            log.close()
        shutil.rmtree(self.root, ignore_errors=True)
