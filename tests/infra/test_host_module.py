"""twinkle-host applied against this machine (ssh_target empty: the scripts run locally instead of
over ssh), service_manager process: install.sh (idempotent, already done), the server config,
`twinkle serve` started detached, the module's health probe, then destroy stops it. The tiny
model, a free port and a temp data dir keep it cheap; a finalizer kills the server's process
group if the test fails anywhere in between."""

from __future__ import annotations

import os
import signal
import socket
import time
from pathlib import Path

import httpx
import yaml

from engine.config import TINY_MODEL_NAME
from gateway.config import ServerConfig
from tests.infra import tools


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(1)
        return s.connect_ex(("127.0.0.1", port)) == 0


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def test_host_module_apply_probe_destroy(tmp_path: Path) -> None:
    root = tools.copy_tree(tmp_path)
    data = tmp_path / "data"
    port = _free_port()
    work = root / "loopback"
    work.mkdir()
    (work / "main.tf").write_text(
        f"""
module "host" {{
  source          = "../modules/twinkle-host"
  install_dir     = "{tools.REPO}"
  data_dir        = "{data}"
  config_path     = "{data}/server.yaml"
  bind_host       = "127.0.0.1"
  port            = {port}
  service_manager = "process"
  service_name    = "twinkle-test"
  stop_timeout_seconds = 60
  server_config = {{
    models = [{{
      name    = "{TINY_MODEL_NAME}"
      trainer = {{ torch_threads = 1 }}
      sampler = {{ torch_threads = 1 }}
    }}]
    ray = {{ num_cpus = 2 }}
  }}
}}
output "host" {{ value = module.host }}
"""
    )
    pid_file = data / "twinkle-test.pid"

    def kill_leftovers() -> None:
        if pid_file.exists():
            pgid = int(pid_file.read_text())
            if _group_alive(pgid):
                os.killpg(pgid, signal.SIGKILL)

    try:
        tools.init(work)
        t0 = time.monotonic()
        tools.terraform("apply", "-auto-approve", "-no-color", cwd=work, timeout=900)
        applied_s = time.monotonic() - t0
        out = tools.outputs(work)["host"]
        # apply returned only after the module's probe saw 200: it is up now
        assert out["health_url"] == f"http://127.0.0.1:{port}/api/v1/healthz"
        assert httpx.get(out["health_url"], timeout=10).status_code == 200
        assert out["pid_file"] == str(pid_file)
        pgid = int(pid_file.read_text())
        assert _group_alive(pgid)
        written = ServerConfig.from_yaml(data / "server.yaml")
        assert [m.name for m in written.models] == [TINY_MODEL_NAME]
        assert yaml.safe_load(out["server_config_yaml"]) == yaml.safe_load(
            (data / "server.yaml").read_text()
        )
        assert f"--port {port}" in out["systemd_unit"]
        assert f"ExecStart={tools.REPO}/.venv/bin/twinkle serve" in out["systemd_unit"]

        t0 = time.monotonic()
        tools.terraform("destroy", "-auto-approve", "-no-color", cwd=work, timeout=300)
        destroyed_s = time.monotonic() - t0
        assert not _port_open(port)
        assert not _group_alive(pgid)
        assert not pid_file.exists()
        print(f"twinkle-host on loopback: apply {applied_s:.1f} s, destroy {destroyed_s:.1f} s")
    finally:
        kill_leftovers()
