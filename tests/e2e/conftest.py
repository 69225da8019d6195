"""Real `twinkle serve` processes for the e2e suite, one Ray cluster at a time.

`start_server` starts one (its own data dir with the session's tiny models copied in, a free port,
ready when healthz answers); keys are made with the real `twinkle keys create` against its DB.

Shared servers come from a one-slot pool by profile (`ServerPool`): ``default`` (the `server`
fixture: the tiny chat model, SQLite), ``hosted`` (`start_hosted`), ``megatron`` (`start_mg`,
started by the cookbook's Megatron launcher) and ``observed`` (`start_observed`). Asking for
another profile stops the running one first, and `pytest_collection_modifyitems` orders the e2e
tests by the profile they use, so each profile starts once; a test whose last act stops its
profile's server takes it out of the pool (`ServerPool.take`) and runs last in its group. Tests
marked ``own_cluster`` start their own servers or Ray clusters (they kill or restart them); the
pool is emptied before each, and they run after all pooled tests.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.launch import Launched, launch
from tests.tiny_models import seed_models

REPO = Path(__file__).resolve().parents[2]
TWINKLE = str(Path(sys.executable).parent / "twinkle")
STARTUP_TIMEOUT_S = 240
#: a client's server and key: never inherited from the test process into `Server.env` (which
#: tests hand to client subprocesses), where they would point an SDK at another server or key
CLIENT_ENV = frozenset(
    {"TINKER_BASE_URL", "TINKER_API_KEY", "TWINKLE_SERVER_URL", "TWINKLE_SERVER_TOKEN"}
)
#: the default profile's config: no start-up probe (`execution: auto` has its own unit tests and
#: the zero-config start is tests/e2e/test_serve_lifecycle.py's)
DEFAULT_CONFIG = "models:\n  - name: twinkle/tiny-chat\n    execution: sequential\n"
#: the ``observed`` profile: two Samplers (tests/e2e/test_observability.py kills one of them) and
#: a drain window and Retry-After that tests/e2e/test_drain.py checks when it stops the server
OBSERVED_CONFIG = """
drain_timeout_seconds: 120
drain_retry_after_seconds: 7
models:
  - name: twinkle/tiny-chat
    execution: sequential
    sampler: {num_replicas: 2}
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, url: str, data_dir: Path, env: dict[str, str], proc: subprocess.Popen):
        self.url, self.data_dir, self.env, self.proc = url, data_dir, env, proc
        self.keys: dict[str, str] = {}  # user -> the key fixtures share (`api_key`)
        #: the cookbook launcher that started it, when one did (tests/e2e/quickstart.py)
        self.quickstart: Any = None

    def create_key(self, user: str, admin: bool = False) -> str:
        cmd = [TWINKLE, "keys", "create", "--user", user] + (["--admin"] if admin else [])
        out = subprocess.run(
            cmd, env=self.env, capture_output=True, text=True, check=True, timeout=120
        )
        return out.stdout.strip().splitlines()[-1]


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/api/v1/healthz", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def start_server(
    data_dir: Path, config: Path | None = None, env: dict[str, str] | None = None
) -> tuple[Server, Launched]:
    """A `twinkle serve` subprocess on a free port with ``data_dir``, ready (healthz 200);
    returns it and its `Launched` handle. ``env``: extra variables for the server and for the
    `Server`'s CLI calls (e.g. ``TWINKLE_DATABASE_URL``). Stop it with `stop_server`."""
    seed_models(data_dir)
    port = _free_port()
    env = dict(
        {k: v for k, v in os.environ.items() if k not in CLIENT_ENV},
        TWINKLE_DATA_DIR=str(data_dir),
        TINKER_TELEMETRY="0",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        **(env or {}),
    )
    cmd = [TWINKLE, "serve", "--host", "127.0.0.1", "--port", str(port)]
    if config is not None:
        cmd += ["--config", str(config)]
    url = f"http://127.0.0.1:{port}"
    started = launch(
        cmd,
        ready=lambda: _healthy(url),
        log=data_dir / "serve.log",
        env=env,
        cwd=REPO,
        timeout=STARTUP_TIMEOUT_S,
        new_ray_cluster="RAY_ADDRESS" not in env,
    )
    return Server(url, data_dir, env, started.proc), started


def stop_server(srv: Server, started: Launched) -> None:
    started.stop(timeout=60)


class ServerPool:
    """At most one shared `twinkle serve` alive: `get` returns the running server of a profile,
    or stops the running one and starts the profile's."""

    def __init__(self) -> None:
        self.held: tuple[str, Server, Launched] | None = None
        #: profile -> why it failed to start: not tried again (each try can take minutes)
        self.failed: dict[str, Exception] = {}

    def get(self, profile: str, start: Callable[[], tuple[Server, Launched]]) -> Server:
        if self.held is not None and self.held[0] == profile:
            return self.held[1]
        if profile in self.failed:
            raise RuntimeError(f"profile {profile!r} failed to start") from self.failed[profile]
        self.release()
        try:
            srv, started = start()
        except Exception as exc:
            self.failed[profile] = exc
            raise
        self.held = (profile, srv, started)
        return srv

    def take(
        self, profile: str, start: Callable[[], tuple[Server, Launched]]
    ) -> tuple[Server, Launched]:
        """The profile's server, no longer the pool's: the caller stops it (a test whose last
        act is to stop or drain it)."""
        self.get(profile, start)
        assert self.held is not None
        _, srv, started = self.held
        self.held = None
        return srv, started

    def release(self) -> None:
        if self.held is not None:
            _, srv, started = self.held
            self.held = None
            stop_server(srv, started)


@pytest.fixture(scope="session")
def pool() -> Iterator[ServerPool]:
    p = ServerPool()
    yield p
    p.release()


@pytest.fixture(scope="session")
def start_default(
    tmp_path_factory: pytest.TempPathFactory,
) -> Callable[[], tuple[Server, Launched]]:
    """Starts the default profile: the tiny chat model on SQLite, `DEFAULT_CONFIG`."""

    def start() -> tuple[Server, Launched]:
        data = tmp_path_factory.mktemp("twinkle-data")
        (data / "server.yaml").write_text(DEFAULT_CONFIG)
        return start_server(data, data / "server.yaml")

    return start


@pytest.fixture(scope="session")
def start_observed(
    tmp_path_factory: pytest.TempPathFactory,
) -> Callable[[], tuple[Server, Launched]]:
    """Starts the observed profile, `OBSERVED_CONFIG`: scraped by Prometheus, then drained."""

    def start() -> tuple[Server, Launched]:
        data = tmp_path_factory.mktemp("observed-data")
        (data / "server.yaml").write_text(OBSERVED_CONFIG)
        return start_server(data, data / "server.yaml")

    return start


@pytest.fixture(scope="session")
def start_hosted(
    tmp_path_factory: pytest.TempPathFactory, redis_url: str, postgres_url: str
) -> Callable[[], tuple[Server, Launched]]:
    """Starts the hosted profile (tests/e2e/hosted_profile.py: Postgres, Redis, two gateway
    replicas, JWT, quotas)."""
    from tests.e2e.hosted_profile import start_hosted_server  # it imports this module

    return lambda: start_hosted_server(tmp_path_factory, redis_url, postgres_url)


@pytest.fixture(scope="session")
def start_mg(tmp_path_factory: pytest.TempPathFactory) -> Callable[[], tuple[Server, Launched]]:
    """Starts the megatron profile through the Megatron quick-start launcher
    (tests/e2e/quickstart.py: TP=2, beside the same weights on the Transformers backend)."""
    from tests.e2e.quickstart import start_megatron_quickstart  # it imports this module

    return lambda: start_megatron_quickstart(tmp_path_factory)


@pytest.fixture(scope="module")
def server(pool: ServerPool, start_default) -> Server:
    return pool.get("default", start_default)


@pytest.fixture(scope="module")
def api_key(server: Server) -> str:
    if "alice" not in server.keys:
        server.keys["alice"] = server.create_key("alice")
    return server.keys["alice"]


@pytest.fixture(autouse=True)
def _own_cluster_runs_alone(request: pytest.FixtureRequest) -> None:
    """A test that starts its own server or Ray cluster runs with no pooled server alive."""
    if request.node.get_closest_marker("own_cluster") is not None:
        request.getfixturevalue("pool").release()


#: starter fixture -> its pool profile (a test's fixture closure names the profiles it uses)
PROFILE_OF_FIXTURE = {
    "start_default": "default",
    "start_mg": "megatron",
    "start_hosted": "hosted",
    "start_observed": "observed",
}
#: run order: tests without a server, then each profile once, then the own-cluster tests
#: (``default`` right before ``megatron``: the parity test on both starts neither again)
ORDER = ["none", "default", "megatron", "hosted", "observed", "own_cluster"]


def _group(item: pytest.Item) -> tuple[int, int]:
    """(place in `ORDER`, 0 for a test on two profiles, 2 for a module that sets
    ``LAST_ON_ITS_SERVER``, else 1). A test on two profiles (the Megatron parity test:
    ``default``, then ``megatron``) runs first in its last profile's group, while the first is
    still alive from its own group; it asks for them in `ORDER`. A module that leaves server-wide
    state behind (the API fuzz as an admin: org quotas, users) or stops the server (the drain
    test) runs after the rest of its group."""
    if item.get_closest_marker("own_cluster") is not None:
        return ORDER.index("own_cluster"), 1
    names = getattr(item, "fixturenames", ())
    profiles = {PROFILE_OF_FIXTURE[n] for n in names if n in PROFILE_OF_FIXTURE}
    if len(profiles) > 1:
        return max(ORDER.index(p) for p in profiles), 0
    last = getattr(getattr(item, "module", None), "LAST_ON_ITS_SERVER", False)
    return max((ORDER.index(p) for p in profiles), default=0), 2 if last else 1


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Order the e2e tests by `_group` (stable: file order within a group); other layers keep
    their place ahead of them."""
    e2e = [i for i in items if "tests/e2e/" in i.nodeid]
    if not e2e:
        return
    rest = [i for i in items if "tests/e2e/" not in i.nodeid]
    items[:] = rest + sorted(e2e, key=_group)
