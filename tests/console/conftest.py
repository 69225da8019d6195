"""Console-test fixtures: one real gateway for the whole console suite, served over HTTP by
uvicorn in this process (in-process engine on the tiny model, real SQLite), as the console sees a
deployed one; and its admin key. AppTest runs the console script in this process too, so the
console's httpx client talks to the gateway over a real socket."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import uvicorn

from tests.gateway.harness import build_engines, make_app, new_key, sqlite_url
from tests.services import free_port

APP = str(Path(__file__).resolve().parents[2] / "admin_ui" / "app.py")


@dataclass
class Gateway:
    url: str
    db_url: str
    admin_key: str

    def key(self, user: str, org: str | None = "acme", scope: str = "user") -> str:
        return new_key(self.db_url, user, org=org, scope=scope)

    def http(self, key: str) -> httpx.Client:
        """A plain client of the gateway with ``key`` (to check what the console did)."""
        return httpx.Client(base_url=self.url, headers={"X-API-Key": key}, timeout=30)


@pytest.fixture(scope="session")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    data = Path(tmp_path_factory.mktemp("console"))
    db_url = sqlite_url(data)
    app = make_app(data, db_url, build_engines(data, 1)[0])
    port = free_port()
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    t = threading.Thread(target=srv.run, daemon=True)
    t.start()
    deadline = time.monotonic() + 60
    while not srv.started and time.monotonic() < deadline:
        time.sleep(0.1)
    assert srv.started, "the gateway did not start"
    admin = new_key(db_url, "root", org="ops", scope="admin")
    yield Gateway(f"http://127.0.0.1:{port}", db_url, admin)
    srv.should_exit = True
    t.join(30)
