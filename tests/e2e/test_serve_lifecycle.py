"""`twinkle serve` lifecycle: strict config, readiness, and a SIGTERM that leaves no process."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

from tests.e2e.conftest import TWINKLE, _free_port, _healthy
from tests.launch import launch
from tests.tiny_models import seed_models

pytestmark = [pytest.mark.e2e, pytest.mark.own_cluster]


def _session_pids(sid: int) -> set[int]:
    pids = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        if int(text[text.rfind(")") + 2 :].split()[3]) == sid:
            pids.add(int(stat.parent.name))
    return pids


def _non_loopback_listeners(pids: set[int]) -> list[str]:
    """Listening TCP sockets of ``pids`` bound to anything but loopback (ss from iproute2)."""
    out = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, check=True).stdout
    bad = []
    for line in out.splitlines():
        cols = line.split()
        local = cols[3]
        owners = {int(p) for p in re.findall(r"pid=(\d+)", line)}
        if owners & pids and not local.startswith(("127.", "[::1]", "[::ffff:127.", "localhost")):
            # Known exception: Ray Serve 2.60 replicas bind their inter-deployment gRPC server to
            # "[::]:0", hard-coded in ray/serve/_private/replica.py (see README, Security).
            if "ray::ServeRepli" in line and local.startswith("*:"):
                continue
            bad.append(line)
    return bad


def _session_members(sid: int) -> list[str]:
    """Processes whose session id is ``sid`` (Ray's gcs, raylet and workers inherit it)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        fields = text[text.rfind(")") + 2 :].split()
        if int(fields[3]) == sid:  # field 6 of stat: session id
            found.append(text[: text.rfind(")") + 1])
    return found


def _nice_values(sid: int) -> dict[str, set[int]]:
    """{process name: the nice values of its threads} for session ``sid``."""
    out: dict[str, set[int]] = {}
    for pid in _session_pids(sid):
        try:
            argv = (Path("/proc") / str(pid) / "cmdline").read_bytes().split(b"\0")
            name = argv[0].decode().split()[0].split(".")[0]  # ray::Class.method while it runs
            if not name.startswith("ray::"):
                name = " ".join(Path(a.decode()).name for a in argv[:3])
            tids = [int(t.name) for t in (Path("/proc") / str(pid) / "task").iterdir()]
            out.setdefault(name, set()).update(os.getpriority(os.PRIO_PROCESS, t) for t in tids)
        except (OSError, IndexError):
            continue
    return out


def _gcs_log_dir(sid: int) -> Path:
    """The log folder of the Ray session whose GCS is in session ``sid`` (its --log_dir)."""
    for pid in _session_pids(sid):
        with contextlib.suppress(OSError):
            argv = (Path("/proc") / str(pid) / "cmdline").read_bytes().decode().split("\0")
            if argv and argv[0].endswith("gcs_server"):
                return Path(next(a for a in argv if a.startswith("--log_dir=")).split("=", 1)[1])
    raise AssertionError("no GCS in the server's session")


def _listener_commands(port: int) -> list[str]:
    """The process names (``ray::ProxyActor``, ``ray::ServeRepli``...) listening on ``port``."""
    out = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, check=True).stdout
    return [
        name
        for line in out.splitlines()
        if line.split()[3].endswith(f":{port}")
        for name in re.findall(r'\("([^"]+)",pid=', line)
    ]


def _serve_expecting_exit(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    """`twinkle serve ARGS` with its data in ``tmp_path/data``, run to its (early) exit."""
    env = dict(os.environ, TWINKLE_DATA_DIR=str(tmp_path / "data"))
    return subprocess.run(
        [TWINKLE, "serve", *args], env=env, capture_output=True, text=True, timeout=120
    )


def test_busy_port_is_refused_before_start_up(tmp_path):
    """A port another program holds stops `twinkle serve` at once (exit 2, one line naming it),
    before migrations, models or Ray."""
    port = _free_port()
    with socket.socket() as other:
        other.bind(("127.0.0.1", port))
        other.listen(1)
        t0 = time.monotonic()
        out = _serve_expecting_exit(tmp_path, "--port", str(port))
    assert out.returncode == 2, out.stderr[-2000:]
    assert f"port {port} on 127.0.0.1 is in use by another process" in out.stderr
    assert "Traceback" not in out.stderr and "Twinkle ready" not in out.stdout
    assert not (tmp_path / "data" / "twinkle.db").exists()  # refused before migrating
    assert time.monotonic() - t0 < 60


def test_unknown_config_key_is_an_error_naming_it(tmp_path):
    cfg = tmp_path / "bad.yaml"
    cfg.write_text("port: 8000\nmodels:\n  - name: twinkle/tiny-chat\n    max_lora_rnak: 8\n")
    out = _serve_expecting_exit(tmp_path, "--config", str(cfg))
    assert out.returncode != 0
    assert "models.0.max_lora_rnak" in out.stderr


def test_sigterm_shuts_down_ray_completely(tmp_path):
    port = _free_port()
    env = dict(os.environ, TWINKLE_DATA_DIR=str(tmp_path))
    seed_models(tmp_path)
    url = f"http://127.0.0.1:{port}"
    started = launch(
        [TWINKLE, "serve", "--port", str(port)],
        ready=lambda: _healthy(url),
        log=tmp_path / "serve.log",
        env=env,
    )
    proc = started.proc
    try:
        assert len(_session_members(proc.pid)) > 3  # driver + gcs + raylet + replicas
        # ray.housekeeping_nice (10): Ray's housekeeping processes run at nice 10 (threads Ray
        # itself put at 15, a worker's task threads, stay there: a nice value is only raised);
        # the replicas and the raylet (whose future workers inherit its value) are untouched
        # applied in one pass after the deploy, before "ready" is printed: healthz answers before
        # that pass ends (the controller can be at 10 while the GCS is still at 0)
        deadline = time.monotonic() + 60
        while "Twinkle ready at" not in (tmp_path / "serve.log").read_text():
            assert time.monotonic() < deadline, (tmp_path / "serve.log").read_text()[-3000:]
            time.sleep(0.5)
        nice = _nice_values(proc.pid)
        assert nice["ray::ServeController"] <= {10, 15}, nice
        assert next(v for k, v in nice.items() if k.startswith("gcs_server")) == {10}, nice
        for name in ("ray::ServeReplica:twinkle:gateway", "ray::ServeReplica:twinkle:trainer"):
            replica = set().union(*(v for k, v in nice.items() if k.startswith(name)))
            assert replica and replica <= {0, 15}, nice  # as Ray started them
        assert set().union(*(v for k, v in nice.items() if k.startswith("raylet"))) == {0}, nice
        # ray.serve_quiet_loop_s (1.0): Serve's controller runs gateway/cli/controller_loop.py,
        # which `twinkle serve` installs through Serve's controller callback; it says so in the
        # controller's log (in the Ray session's log folder, from the GCS's --log_dir)
        log_dir = _gcs_log_dir(proc.pid)
        deadline = time.monotonic() + 30
        while not any(
            "a full control-loop pass every 1s while Serve is quiet" in f.read_text()
            for f in (log_dir / "serve").glob("controller_*.log")
        ):
            assert time.monotonic() < deadline, sorted((log_dir / "serve").glob("*"))
            time.sleep(0.5)
        if shutil.which("ss"):
            assert _non_loopback_listeners(_session_pids(proc.pid)) == []
            # gateway.ingress: direct (the default): the gateway replica itself listens, and no
            # Serve proxy was started
            assert _listener_commands(port) == ["ray::ServeRepli"]
            assert not any("ProxyActor" in m for m in _session_members(proc.pid))
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=90) == 0
        deadline = time.monotonic() + 30
        while _session_members(proc.pid) and time.monotonic() < deadline:
            time.sleep(1)
        assert _session_members(proc.pid) == []
    finally:
        if proc.poll() is None:
            started.kill()
        started.stop()
