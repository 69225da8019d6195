"""A real `twinkle serve` (Ray Serve, SQLite, the tiny model) for the e2e suite, started once.

The server runs as a subprocess of the test session with its own data dir and a free port; keys are
made with the real `twinkle keys create` command against the same DB.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

REPO = Path(__file__).resolve().parents[2]
TWINKLE = str(Path(sys.executable).parent / "twinkle")
STARTUP_TIMEOUT_S = 240


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, url: str, data_dir: Path, env: dict[str, str], proc: subprocess.Popen):
        self.url, self.data_dir, self.env, self.proc = url, data_dir, env, proc

    def create_key(self, user: str, admin: bool = False) -> str:
        cmd = [TWINKLE, "keys", "create", "--user", user] + (["--admin"] if admin else [])
        out = subprocess.run(
            cmd, env=self.env, capture_output=True, text=True, check=True, timeout=120
        )
        return out.stdout.strip().splitlines()[-1]


def start_server(
    data_dir: Path, config: Path | None = None, env: dict[str, str] | None = None
) -> tuple[Server, object]:
    """A `twinkle serve` subprocess on a free port with ``data_dir``, ready (healthz 200);
    returns it and its open log file. ``env``: extra variables for the server and for the
    `Server`'s CLI calls (e.g. ``TWINKLE_DATABASE_URL``). Stop it with `stop_server`."""
    port = _free_port()
    env = dict(
        os.environ,
        TWINKLE_DATA_DIR=str(data_dir),
        TINKER_TELEMETRY="0",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        **(env or {}),
    )
    log = open(data_dir / "serve.log", "w")  # noqa: SIM115 (the server writes it until teardown)
    cmd = [TWINKLE, "serve", "--host", "127.0.0.1", "--port", str(port)]
    if config is not None:
        cmd += ["--config", str(config)]
    proc = subprocess.Popen(
        cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while True:
        if proc.poll() is not None:
            raise RuntimeError(
                f"twinkle serve exited early:\n{(data_dir / 'serve.log').read_text()[-4000:]}"
            )
        try:
            if httpx.get(f"{url}/api/v1/healthz", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            os.killpg(proc.pid, signal.SIGKILL)
            raise RuntimeError(
                f"twinkle serve not ready:\n{(data_dir / 'serve.log').read_text()[-4000:]}"
            )
        time.sleep(0.25)  # a start takes ~10 s; 1 s polls wasted ~0.5 s of each
    return Server(url, data_dir, env, proc), log


def stop_server(srv: Server, log) -> None:
    srv.proc.send_signal(signal.SIGTERM)
    try:
        srv.proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(srv.proc.pid, signal.SIGKILL)
        srv.proc.wait()
    log.close()


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory):
    srv, log = start_server(tmp_path_factory.mktemp("twinkle-data"))
    yield srv
    stop_server(srv, log)


@pytest.fixture(scope="session")
def api_key(server: Server) -> str:
    return server.create_key("alice")
