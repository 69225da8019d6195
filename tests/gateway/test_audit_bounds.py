"""What unauthenticated requests can make the database hold, through the real gateway app (real
SQLite, its own expiry sweep): an ``access_denied`` row stays under 1 KiB whatever the path, a
concurrent flood of bad keys writes no more rows than the per-minute throttle, and the sweep
prunes those rows past the row cap and the retention age while admin events stay."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import pytest
import sqlalchemy as sa

import gateway.accounts.audit as audit
from gateway.db import make_engine
from gateway.db.tables import utcnow

ENGINE_BACKEND = "mock"  # HTTP semantics only (tests/gateway/conftest.py)
BAD = {"X-API-Key": "tml-not-a-key"}


@pytest.fixture(scope="module")
def gw(make_gateway):
    return make_gateway()


@pytest.fixture(scope="module")
def swept(make_gateway):
    """A gateway whose sweep runs every 0.2 s and keeps at most 5 denied rows for a day."""
    return make_gateway(
        session_sweep_seconds=0.2,
        gateway={"audit_denied_max_rows": 5, "audit_denied_retention_days": 1},
    )


@pytest.fixture
def throttle(monkeypatch: pytest.MonkeyPatch):
    """A fresh throttle window with room for ``n`` rows."""

    def set_to(n: int) -> None:
        monkeypatch.setattr(audit, "DENIED_PER_MINUTE", n)
        monkeypatch.setattr(audit, "_denied_window", {"minute": 0, "count": 0})

    return set_to


def _denied_rows(gw) -> list[tuple[int, str]]:
    db = make_engine(gw.db_url)
    try:
        with db.connect() as conn:
            q = "SELECT id, details FROM audit_events WHERE event = 'access_denied' ORDER BY id"
            return [
                (i, d if isinstance(d, str) else json.dumps(d)) for i, d in conn.execute(sa.text(q))
            ]
    finally:
        db.dispose()


def _wait_for(pred, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "the expiry sweep did not prune in time"
        time.sleep(0.1)


def test_a_denied_row_stays_small_whatever_the_path(gw, throttle) -> None:
    throttle(100)
    before = {i for i, _ in _denied_rows(gw)}
    long_id = "a" * 60_000
    r = gw.client.get(f"/api/v1/training_runs/{long_id}", headers=BAD)
    assert r.status_code == 401
    (row,) = [d for i, d in _denied_rows(gw) if i not in before]
    assert len(row.encode()) < 1024, len(row)
    details = json.loads(row)
    assert details["route"] == "/api/v1/training_runs/{run_id:path}"
    assert details["path"] == f"/api/v1/training_runs/{long_id}"[: audit.DENIED_PATH_CHARS]


def test_a_concurrent_flood_writes_no_more_than_the_throttle(gw, throttle) -> None:
    throttle(7)
    before = len(_denied_rows(gw))

    def bad(_: int) -> int:
        return gw.client.get("/api/v1/get_server_capabilities", headers=BAD).status_code

    with ThreadPoolExecutor(8) as pool:
        assert set(pool.map(bad, range(64))) == {401}
    # 7 rows written (a minute boundary mid-flood opens one more window)
    assert len(_denied_rows(gw)) - before in (7, 14)


def test_the_sweep_prunes_past_the_row_cap_and_the_retention_age(swept, throttle) -> None:
    gw = swept
    throttle(1000)
    admin = gw.key("root", org="ops", scope="admin")
    for _ in range(20):
        assert gw.client.get("/api/v1/admin/keys", headers=BAD).status_code == 401
    _wait_for(lambda: len(_denied_rows(gw)) <= 5)
    # the cap keeps the newest rows
    newest = gw.client.get(
        "/api/v1/admin/audit", params={"event": "access_denied"}, headers={"X-API-Key": admin}
    ).json()["entries"]
    assert newest and all(e["event_details"]["route"] == "/api/v1/admin/keys" for e in newest)
    # age: move the rows two days back; the sweep deletes them all, the admin events stay
    db = make_engine(gw.db_url)
    try:
        with db.begin() as conn:
            conn.execute(
                sa.text("UPDATE audit_events SET created_at = :t"),
                {"t": utcnow() - timedelta(days=2)},
            )
        _wait_for(lambda: not _denied_rows(gw))
        with db.connect() as conn:
            left = conn.execute(sa.text("SELECT event FROM audit_events")).scalars().all()
    finally:
        db.dispose()
    assert "key_created" in left and "access_denied" not in left
