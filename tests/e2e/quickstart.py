"""The cookbook's quick-start launchers (``cookbook/client/server/<backend>/server.py``) started as
a user starts them: the system python, nothing Twinkle-specific in the environment, the shipped
config moved to a free port, the user's directory holding the server's data in ``./.twinkle``.

`launch_quickstart` starts one; `start_megatron_quickstart` is the pool's ``megatron`` profile: the
Megatron quick start with the same weights also served on the Transformers backend (the Megatron
e2e tests compare the two), which tests/e2e/test_cookbook_servers.py also checks as the Megatron
quick start.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from tests.e2e.conftest import Server, _free_port
from tests.launch import Launched, launch
from tests.tiny_models import seed_models

REPO = Path(__file__).resolve().parents[2]
SERVERS = REPO / "cookbook" / "client" / "server"
# "python server.py" as a user types it: the system python, which has no twinkle installed, so
# server.py re-runs itself in the repo's .venv
PLAIN_PYTHON = shutil.which("python3", path="/usr/local/bin:/usr/bin:/bin") or sys.executable
#: the Transformers-backed twin of the Megatron model in the ``megatron`` profile
TF_TWIN = "tiny-transformers"


def plain_env(**extra: str) -> dict[str, str]:
    """A user's shell: nothing Twinkle-specific set."""
    return {"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/root"), **extra}


@dataclass
class Quickstart:
    """A started quick start: its process, its log, the user's directory (``work``) and the URL
    and key it printed."""

    started: Launched
    work: Path
    url: str
    token: str

    def text(self) -> str:
        return self.started.text()


def launch_quickstart(backend: str, tmp: Path, extra_models: tuple[dict, ...] = ()) -> Quickstart:
    """``python cookbook/client/server/<backend>/server.py`` in ``tmp/work`` with the shipped
    config moved to a free port (and ``extra_models`` appended), ready when it prints
    ``Twinkle ready``."""
    config = yaml.safe_load((SERVERS / backend / "server_config.yaml").read_text())
    config["port"] = _free_port()
    config["models"] += list(extra_models)
    cfg_path = tmp / "server_config.yaml"
    cfg_path.write_text(yaml.safe_dump(config))
    work = tmp / "work"  # the user's directory: the server's data goes to ./.twinkle
    seed_models(work / ".twinkle")
    started = launch(
        [PLAIN_PYTHON, str(SERVERS / backend / "server.py")],
        ready="Twinkle ready",
        log=tmp / "server.log",
        env=plain_env(TWINKLE_SERVER_CONFIG=str(cfg_path)),
        cwd=work,
        kind="launcher",
    )
    m = re.search(r"export TWINKLE_SERVER_URL=(\S+) TWINKLE_SERVER_TOKEN=(\S+)", started.text())
    if m is None:
        started.stop()
        raise RuntimeError(f"no URL and key printed:\n{started.text()[-2000:]}")
    return Quickstart(started, work, m.group(1), m.group(2))


def start_megatron_quickstart(
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[Server, Launched]:
    """The ``megatron`` profile: the Megatron quick start (its shipped model entry unchanged: TP=2)
    plus `TF_TWIN`, the same folder on the Transformers backend. The `Server` carries the
    `Quickstart` as ``quickstart``."""
    tmp = tmp_path_factory.mktemp("megatron-quickstart")
    model_dir = tmp / "work" / ".twinkle" / "models" / "tiny-chat"  # seeded by the launch
    twin = {
        "name": TF_TWIN,
        "path": str(model_dir),
        "execution": "sequential",
        "trainer": {"num_cpus": 0.25},
        "sampler": {"num_cpus": 0.25},
    }
    qs = launch_quickstart("megatron", tmp, (twin,))
    data_dir = qs.work / ".twinkle"
    env = dict(
        os.environ,
        TWINKLE_DATA_DIR=str(data_dir),
        TINKER_TELEMETRY="0",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
    )
    srv = Server(qs.url, data_dir, env, qs.started.proc)
    srv.quickstart = qs
    return srv, qs.started
