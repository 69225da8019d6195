"""Real components the fault tests break on purpose: a Ray head the server joins (so a test can
`ray.kill` a Serve replica), a redis-server that can be restarted on the same port, a TCP proxy in
front of Postgres that can be closed (Postgres "unavailable") and reopened, and a small tmpfs for
the checkpoint folder (a full disk).

Run as ``python -m tests.e2e.fault_services kill RAY_ADDRESS NAME_PART`` to `ray.kill` a live
Serve replica actor whose name contains NAME_PART (e.g. ``#trainer-``); it prints "ready"
once connected, waits for a line on stdin, kills, and prints the name. A separate process, so the
pytest process never becomes a Ray driver; connected ahead, so the kill lands within milliseconds
of the test's cue (joining Ray takes seconds on a loaded machine).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from tests.launch import count_ray_cluster
from tests.services import _wait_port, free_port, redis_binary

VENV_BIN = Path(sys.executable).parent
#: the test's own loopback-only head: Ray's token auth off, so the server and the kill helper
#: join it with the address alone (set in their environments too)
RAY_ENV = {"RAY_AUTH_MODE": "disabled"}


class RayHead:
    """``ray start --head --block`` in its own process group; `stop` ends that group only.
    Ready once it logs "Ray runtime started"; a start that dies (a raylet timing out on a loaded
    machine) is tried again, up to ``tries`` times."""

    def __init__(self, tries: int = 3) -> None:
        for attempt in range(tries):
            self._start()
            if self._wait_started():
                return
            self.stop()
            if attempt == tries - 1:
                raise RuntimeError(f"ray start --head failed: {Path(self.log.name).read_text()}")

    def _start(self) -> None:
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile(  # noqa: SIM115 (closed in stop)
            prefix="twinkle-rayhead-", suffix=".log", delete=False
        )
        env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0", **RAY_ENV)
        # A private, short temp dir (unix sockets: 107 bytes): with the default, `ray start` records
        # this cluster in /tmp/ray/ray_current_cluster and later bare ray.init() calls join it dead.
        self.temp_dir = tempfile.mkdtemp(prefix="twinkle-rayf.", dir="/tmp")
        count_ray_cluster()
        self.proc = subprocess.Popen(
            [
                str(VENV_BIN / "ray"),
                "start",
                "--head",
                "--block",
                f"--port={self.port}",
                "--node-ip-address=127.0.0.1",
                "--num-cpus=4",
                "--include-dashboard=false",
                "--disable-usage-stats",
                f"--dashboard-agent-listen-port={free_port()}",
                f"--runtime-env-agent-port={free_port()}",
                f"--metrics-export-port={free_port()}",
                "--object-store-memory=200000000",
                f"--temp-dir={self.temp_dir}",
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )

    def _wait_started(self, timeout: float = 240) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if "Ray runtime started" in Path(self.log.name).read_text(errors="replace"):
                return True
            if self.proc.poll() is not None:
                return False
            time.sleep(0.5)
        return False

    def stop(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.log.close()
        shutil.rmtree(self.temp_dir, ignore_errors=True)


class RestartableRedis:
    """A redis-server (no persistence) on a fixed free port; `restart` kills it (SIGKILL) and
    starts a fresh one on the same port: every key is gone, every connection broken."""

    def __init__(self) -> None:
        binary = redis_binary()
        if binary is None:
            raise FileNotFoundError("redis-server is not installed (apt-get install redis-server)")
        self.binary, self.port = binary, free_port()
        self.workdir = tempfile.mkdtemp(prefix="twinkle-redis-fault-")
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen | None = None
        self.start()

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", ""]
            + ["--appendonly", "no", "--dir", self.workdir],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        _wait_port(self.port)

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None

    def restart(self) -> None:
        self.kill()
        self.start()

    def stop(self) -> None:
        self.kill()
        shutil.rmtree(self.workdir, ignore_errors=True)


class TcpProxy:
    """A loopback TCP proxy to ``upstream_port``. `close` stops listening and cuts every open
    connection (clients get "connection refused" / a reset, as when the server is down); `open`
    listens again on the same port."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port, self.port = upstream_port, free_port()
        self._lock = threading.Lock()
        self._conns: list[socket.socket] = []
        self._listener: socket.socket | None = None
        self.open()

    def open(self) -> None:
        srv = socket.socket()
        srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        srv.bind(("127.0.0.1", self.port))
        srv.listen(128)
        self._listener = srv
        threading.Thread(target=self._accept, args=(srv,), daemon=True).start()

    def close(self) -> None:
        with self._lock:
            srv, self._listener = self._listener, None
            conns, self._conns = self._conns, []
        if srv is not None:
            with contextlib.suppress(OSError):
                srv.shutdown(socket.SHUT_RDWR)
            srv.close()
        for c in conns:
            with contextlib.suppress(OSError):
                c.shutdown(socket.SHUT_RDWR)
            c.close()

    def _accept(self, srv: socket.socket) -> None:
        while True:
            try:
                client, _ = srv.accept()
            except OSError:
                return
            try:
                up = socket.create_connection(("127.0.0.1", self.upstream_port), timeout=5)
                up.settimeout(None)
            except OSError:
                client.close()
                continue
            with self._lock:
                if self._listener is not srv:
                    client.close()
                    up.close()
                    return
                self._conns += [client, up]
            for a, b in ((client, up), (up, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)


def mount_tmpfs(path: Path, size: str) -> str | None:
    """Mount a ``size`` tmpfs on ``path`` (created); None, or why it cannot (not root, no
    mount permission in this container)."""
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        return "mounting a tmpfs needs root"
    out = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0755", "tmpfs", str(path)],
        capture_output=True,
        text=True,
    )
    return None if out.returncode == 0 else f"mount -t tmpfs failed: {out.stderr.strip()}"


def unmount(path: Path) -> None:
    subprocess.run(["umount", "-l", str(path)], capture_output=True)


def _kill_replica(address: str, part: str) -> None:
    import ray

    ray.init(address=address, logging_level="ERROR", log_to_driver=False)
    print("ready", flush=True)
    sys.stdin.readline()
    names = [
        a["name"]
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a["namespace"] == "serve"
        and a["name"].startswith("SERVE_REPLICA::")
        and part in a["name"]
    ]
    if not names:
        raise SystemExit(f"no live replica matches {part!r}")
    name = sorted(names)[0]  # of several (gateway replicas), any one
    ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)
    # The moment of the kill, before this process's own Ray shutdown (seconds): the parent's
    # timings start here, not when this helper has exited.
    print(f"{name} {time.time():.6f}", flush=True)


class ReplicaKiller:
    """A connected kill helper for the replica matching ``part``; `kill` fires it and returns
    (the replica's actor name, the monotonic time of the kill)."""

    def __init__(self, address: str, part: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.e2e.fault_services", "kill", address, part],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=dict(os.environ, **RAY_ENV),
            cwd=Path(__file__).resolve().parents[2],
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline().strip()
        if line != "ready":
            self.proc.kill()
            raise RuntimeError(f"kill helper did not connect: {line} {self.proc.stderr.read()}")

    def kill(self) -> tuple[str, float]:
        out, err = self.proc.communicate("go\n", timeout=120)
        if self.proc.returncode != 0:
            raise RuntimeError(f"kill failed: {out}{err[-3000:]}")
        name, killed_at = out.strip().splitlines()[-1].rsplit(" ", 1)
        # the helper's wall-clock kill time on this process's monotonic clock
        return name, time.monotonic() - (time.time() - float(killed_at))


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "kill":
        _kill_replica(sys.argv[2], sys.argv[3])
    else:
        raise SystemExit(__doc__)
