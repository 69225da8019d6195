"""Session fixtures shared by every test layer: offline settings, a real redis-server and Postgres
(tests/services.py), the session's tiny models (tests/tiny_models.py), and the count of servers
and Ray clusters started (tests/launch.py), printed at the end."""

from __future__ import annotations

import os

# Offline model hubs and no telemetry for every test, set before anything imports transformers,
# huggingface_hub or tinker (tests never download; the tiny model is built locally).
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TINKER_TELEMETRY", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
from collections.abc import Iterator

import pytest

from tests import launch, services, tiny_models


@pytest.fixture(scope="session", autouse=True)
def _session_models_and_starts(
    tmp_path_factory: pytest.TempPathFactory, record_testsuite_property
) -> Iterator[None]:
    """Tiny models are built once under the session's temp dir; the starts counted by
    tests/launch.py go into the JUnit report (scripts/test_times.py prints them)."""
    tiny_models.set_root(tmp_path_factory.mktemp("tiny-models"))
    yield
    for kind, n in sorted(launch.STARTS.items()):
        record_testsuite_property(f"starts: {kind}", n)


def pytest_terminal_summary(terminalreporter) -> None:
    terminalreporter.write_line(launch.summary())


def _missing(what: str, exc: Exception) -> None:
    # Under CI a missing service is a broken install, never a silent skip.
    if os.environ.get("CI"):
        raise exc
    pytest.skip(f"{what} not available: {exc}")


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    """URL of a real redis-server started for this test session (flushed by users as needed)."""
    try:
        cm = services.run_redis()
        url = cm.__enter__()
    except (FileNotFoundError, RuntimeError) as exc:
        _missing("redis-server", exc)
    try:
        yield url
    finally:
        cm.__exit__(None, None, None)


@pytest.fixture(scope="session")
def postgres_url() -> Iterator[str]:
    """SQLAlchemy URL of a real Postgres cluster started for this test session."""
    try:
        cm = services.run_postgres()
        url = cm.__enter__()
    except (FileNotFoundError, RuntimeError, OSError) as exc:
        _missing("postgres", exc)
    try:
        yield url
    finally:
        cm.__exit__(None, None, None)


@pytest.fixture(scope="session")
def promtool() -> str:
    """Path of promtool (Debian's prometheus package; a skip outside CI when missing)."""
    try:
        return services.prometheus_binaries()[1]
    except FileNotFoundError as exc:
        _missing("prometheus", exc)
        raise
