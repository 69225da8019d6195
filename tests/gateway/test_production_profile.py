"""The ``production`` profile and migrations once per deploy: Postgres and Redis are required (a
config error naming the key), `twinkle migrate` upgrades once (concurrent upgrades of one Postgres
database take turns on an advisory lock) and `twinkle serve` only checks the head revision.
Real Postgres and Redis (tests/conftest.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from engine.errors import ConfigError
from gateway.config import ServerConfig, check_profile
from gateway.db import check_at_head, current_revision, head_revision, make_engine, upgrade_to_head
from tests.gateway.harness import fresh_postgres_db

TWINKLE = str(Path(sys.executable).parent / "twinkle")
PROD = ServerConfig.model_validate({"profile": "production"})
SQLITE = "sqlite:////tmp/x/twinkle.db"
PG = "postgresql+psycopg://u@127.0.0.1:5432/db"


def _cli(args: list[str], tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [TWINKLE, *args],
        env=dict(os.environ, TWINKLE_DATA_DIR=str(tmp_path / "data"), **env),
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_production_needs_postgres_and_redis_naming_the_keys():
    with pytest.raises(ConfigError) as both:
        check_profile(SQLITE, None, PROD)
    assert "TWINKLE_DATABASE_URL" in str(both.value) and "gateway.redis_url" in str(both.value)
    with pytest.raises(ConfigError) as redis_only:
        check_profile(PG, None, PROD)
    assert "gateway.redis_url" in str(redis_only.value)
    assert "TWINKLE_DATABASE_URL" not in str(redis_only.value)
    with pytest.raises(ConfigError) as db_only:
        check_profile(SQLITE, "redis://127.0.0.1:6379/0", PROD)
    assert "TWINKLE_DATABASE_URL" in str(db_only.value) and "redis" not in str(db_only.value)
    check_profile(PG, "redis://127.0.0.1:6379/0", PROD)  # both: fine
    with_cfg = PROD.model_copy(
        update={"gateway": PROD.gateway.model_copy(update={"redis_url": "redis://h/0"})}
    )
    check_profile(PG, None, with_cfg)  # Redis from the config file counts too
    check_profile(SQLITE, None, ServerConfig())  # development: SQLite and no Redis are fine


def test_unknown_profile_is_a_config_error():
    with pytest.raises(ConfigError, match="profile"):
        ServerConfig.from_dict({"profile": "prod"})


def test_serve_refuses_production_without_postgres(tmp_path):
    cfg = tmp_path / "prod.yaml"
    cfg.write_text("profile: production\n")
    out = _cli(["serve", "--config", str(cfg)], tmp_path)
    assert out.returncode == 2, out.stderr[-2000:]
    assert "profile: production needs" in out.stderr
    assert "TWINKLE_DATABASE_URL" in out.stderr and "gateway.redis_url" in out.stderr


def test_migrate_once_then_serve_only_checks(tmp_path, postgres_url, redis_url):
    db = fresh_postgres_db(postgres_url)
    cfg = tmp_path / "prod.yaml"
    cfg.write_text(f"profile: production\ngateway: {{redis_url: '{redis_url}'}}\n")
    # an empty database: production serve refuses before starting anything, naming the command
    out = _cli(["serve", "--config", str(cfg)], tmp_path, TWINKLE_DATABASE_URL=db)
    assert out.returncode == 2 and "twinkle migrate" in out.stderr, out.stderr[-2000:]
    engine = make_engine(db)
    try:
        assert current_revision(engine) is None  # serve did not migrate
        check = _cli(["migrate", "--check"], tmp_path, TWINKLE_DATABASE_URL=db)
        assert check.returncode == 1 and "twinkle migrate" in check.stderr
        mig = _cli(["migrate"], tmp_path, TWINKLE_DATABASE_URL=db)
        assert mig.returncode == 0, mig.stderr[-2000:]
        assert head_revision() in mig.stdout
        assert current_revision(engine) == head_revision()
        assert _cli(["migrate", "--check"], tmp_path, TWINKLE_DATABASE_URL=db).returncode == 0
        assert check_at_head(db) == head_revision()
    finally:
        engine.dispose()


def test_concurrent_upgrades_of_one_postgres_take_turns(postgres_url):
    """Several deploy steps (or replicas) upgrading at once: the advisory lock lets one migrate
    and the others find the database at head; without it, the second CREATE TABLE fails."""
    db = fresh_postgres_db(postgres_url)
    errors: list[BaseException] = []

    def run() -> None:
        try:
            upgrade_to_head(db)
        except BaseException as e:  # collected: the assertion below names them
            errors.append(e)

    threads = [threading.Thread(target=run) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert errors == []
    assert check_at_head(db) == head_revision()
