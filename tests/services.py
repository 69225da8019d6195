"""Real backing services for tests: a throwaway redis-server, Postgres cluster and Prometheus.

Each starts on a free loopback port inside a temp dir and is stopped at the end of the test
session. Tests that need one take the ``redis_url`` / ``postgres_url`` fixture (tests/conftest.py);
when the binary is missing the fixture skips with the reason, except under CI (``CI=1``), where a
missing service is a failure: .ci/run installs them (scripts/install.sh).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

PG_BIN_DIRS = ["/usr/local/bin", "/usr/lib/postgresql/15/bin", "/usr/lib/postgresql/16/bin"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_port(port: int, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"service on 127.0.0.1:{port} did not come up in {timeout}s")


def redis_binary() -> str | None:
    return shutil.which("redis-server")


@contextmanager
def run_redis() -> Iterator[str]:
    """A redis-server without persistence; yields ``redis://127.0.0.1:PORT/0``."""
    binary = redis_binary()
    if binary is None:
        raise FileNotFoundError("redis-server is not installed (apt-get install -y redis-server)")
    port = free_port()
    workdir = tempfile.mkdtemp(prefix="twinkle-redis-")
    proc = subprocess.Popen(
        [
            binary,
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            workdir,
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        _wait_port(port)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
        shutil.rmtree(workdir, ignore_errors=True)


def _pg_tool(name: str) -> str | None:
    found = shutil.which(name)
    if found:
        return found
    for d in PG_BIN_DIRS:
        p = Path(d) / name
        if p.exists():
            return str(p)
    return None


def postgres_binaries() -> tuple[str, str] | None:
    initdb, pg_ctl = _pg_tool("initdb"), _pg_tool("pg_ctl")
    return (initdb, pg_ctl) if initdb and pg_ctl else None


@contextmanager
def run_postgres() -> Iterator[str]:
    """A fresh Postgres cluster (trust auth, loopback only); yields a SQLAlchemy psycopg URL.

    Postgres refuses to run as root, so as root the cluster belongs to the ``postgres`` user.
    """
    bins = postgres_binaries()
    if bins is None:
        raise FileNotFoundError("initdb/pg_ctl not found (PostgreSQL server is not installed)")
    initdb, pg_ctl = bins
    port = free_port()
    root = Path(tempfile.mkdtemp(prefix="twinkle-pg-"))
    data, sock = root / "data", root / "sock"
    sock.mkdir()
    as_root = os.geteuid() == 0
    user = "postgres" if as_root else os.environ.get("USER", "postgres")
    prefix: list[str] = ["runuser", "-u", "postgres", "--"] if as_root else []
    if as_root:
        shutil.chown(root, "postgres")
        shutil.chown(sock, "postgres")
    subprocess.run(
        [*prefix, initdb, "-D", str(data), "-U", user, "-A", "trust"],
        check=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    opts = f"-c listen_addresses=127.0.0.1 -p {port} -c unix_socket_directories={sock} -c fsync=off"
    subprocess.run(
        [*prefix, pg_ctl, "-D", str(data), "-l", str(root / "pg.log"), "-o", opts, "-w", "start"],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    try:
        _wait_port(port)
        yield f"postgresql+psycopg://{user}@127.0.0.1:{port}/postgres"
    finally:
        subprocess.run(
            [*prefix, pg_ctl, "-D", str(data), "-m", "immediate", "stop"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        shutil.rmtree(root, ignore_errors=True)


def prometheus_binaries() -> tuple[str, str]:
    """(prometheus, promtool) from Debian's ``prometheus`` package (scripts/install.sh)."""
    prom, tool = shutil.which("prometheus"), shutil.which("promtool")
    if prom is None or tool is None:
        raise FileNotFoundError("prometheus / promtool not installed (apt-get install prometheus)")
    return prom, tool


@contextmanager
def run_prometheus(config: Path) -> Iterator[str]:
    """A Prometheus server on ``config`` with its TSDB in a temp dir, on a free loopback port;
    yields its base URL once ``/-/ready`` answers. Its log is ``<config dir>/prometheus.log``."""
    import urllib.request

    prom, _ = prometheus_binaries()
    port = free_port()
    workdir = tempfile.mkdtemp(prefix="twinkle-prom-")
    log = open(config.parent / "prometheus.log", "w")  # noqa: SIM115 (closed below)
    proc = subprocess.Popen(
        [
            prom,
            f"--config.file={config}",
            f"--storage.tsdb.path={workdir}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--web.enable-lifecycle",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                with urllib.request.urlopen(f"{url}/-/ready", timeout=1) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                tail = (config.parent / "prometheus.log").read_text()[-2000:]
                raise RuntimeError(f"prometheus did not start: {tail}")
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()
        shutil.rmtree(workdir, ignore_errors=True)
