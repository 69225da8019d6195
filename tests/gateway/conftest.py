"""Gateway-test fixtures: one app builder, one key factory, one future waiter
(tests/gateway/harness.py holds the plain functions behind them).

    def test_x(make_gateway):
        gw = make_gateway()                       # SQLite, in-process KV, one engine
        key = gw.key("alice")                     # the key factory
        fut = gw.client.post(..., headers={"X-API-Key": key}).json()
        body = gw.wait(fut, key)                  # the future waiter

A module that tests HTTP semantics only (auth, quotas, errors, ...) sets
``ENGINE_BACKEND = "mock"``: its engines run engine/backends/mock.py (no torch, milliseconds per
step); a test about training or sampling numbers keeps the real backend.

Parametrise over the backing services by taking ``each_db`` ("sqlite", "postgres") and/or
``each_kv`` ("memory", "redis") and passing them on: ``make_gateway(db=each_db, kv=each_kv)``.
Postgres and Redis are the real servers of tests/conftest.py.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from gateway.engine_client import EngineClient
from tests.gateway.harness import (
    build_engines,
    fresh_postgres_db,
    make_app,
    new_key,
    sqlite_url,
    wait_future,
)


@dataclass
class GatewayEnv:
    """One running gateway app (entered `TestClient`) and what it was built on."""

    client: TestClient
    app: FastAPI
    data: Path
    db_url: str
    engines: dict
    redis_url: str | None = None
    _stack: ExitStack = field(default_factory=ExitStack, repr=False)

    def key(self, user: str, org: str | None = "acme", scope: str = "user") -> str:
        """A new API key for ``user`` (see `harness.new_key`)."""
        return new_key(self.db_url, user, org=org, scope=scope)

    def wait(self, fut: dict, key: str | None = None, **extra: Any) -> Any:
        """The finished future (see `harness.wait_future`)."""
        return wait_future(self.client, key, fut, **extra)

    def close(self) -> None:
        """Shut the app down now (otherwise at the end of the builder fixture's scope)."""
        self._stack.close()

    def __enter__(self) -> GatewayEnv:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@pytest.fixture(scope="module")
def make_gateway(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Callable[..., GatewayEnv]]:
    """Build a real gateway app, entered in a `TestClient` and shut down at the end of the module
    (or earlier with ``with make_gateway(...) as gw:`` / ``gw.close()``).

    ``db``: "sqlite" (a file under ``data``) or "postgres" (a fresh database on the session's
    server); ``db_url`` overrides both (e.g. two apps on one database). ``kv``: "memory" or
    "redis" (the session's redis-server as ``gateway.redis_url``, flushed first unless
    ``flush_kv=False``: replicas after the first share the first one's state). ``data``: the data
    dir (default: a new temp dir). ``engines``: an engine dict to share (default: a new one,
    `harness.build_engines`) on ``backend``: "transformers", or "mock" for tests of HTTP semantics
    only (default: the module's ``ENGINE_BACKEND``, else "transformers"); ``engine_client``
    replaces the in-process client. ``gateway``: the config's gateway section; ``config``: other
    `ServerConfig` fields."""
    envs: list[GatewayEnv] = []
    module_backend = getattr(request.module, "ENGINE_BACKEND", "transformers")

    def build(
        *,
        db: str = "sqlite",
        kv: str = "memory",
        data: Path | None = None,
        db_url: str | None = None,
        engines: dict | None = None,
        engine_client: EngineClient | None = None,
        gateway: dict | None = None,
        flush_kv: bool = True,
        backend: str | None = None,
        **config: Any,
    ) -> GatewayEnv:
        data = Path(data or tmp_path_factory.mktemp("gateway"))
        if db_url is None:
            if db == "sqlite":
                db_url = sqlite_url(data)
            elif db == "postgres":
                db_url = fresh_postgres_db(request.getfixturevalue("postgres_url"))
            else:
                raise ValueError(f"db: sqlite or postgres, got {db!r}")
        gw = dict(gateway or {})
        redis_url = None
        if kv == "redis":
            import redis

            redis_url = request.getfixturevalue("redis_url")
            if flush_kv:
                redis.Redis.from_url(redis_url).flushdb()
            gw.setdefault("redis_url", redis_url)
        elif kv != "memory":
            raise ValueError(f"kv: memory or redis, got {kv!r}")
        if engines is None:
            engines = build_engines(data, 1, backend or module_backend)[0]
        app = make_app(data, db_url, engines, gateway=gw, engine_client=engine_client, **config)
        stack = ExitStack()
        client = stack.enter_context(TestClient(app))
        env = GatewayEnv(client, app, data, db_url, engines, redis_url, stack)
        envs.append(env)
        return env

    try:
        yield build
    finally:
        for env in reversed(envs):
            env.close()


@pytest.fixture(scope="module", params=["sqlite", "postgres"])
def each_db(request: pytest.FixtureRequest) -> str:
    """Run the module's tests once on SQLite and once on the real Postgres."""
    return request.param


@pytest.fixture(params=["memory", "redis"])
def each_kv(request: pytest.FixtureRequest) -> str:
    """Run the test once with in-process KV stores and once with the real Redis."""
    return request.param
