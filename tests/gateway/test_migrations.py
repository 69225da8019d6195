"""Alembic migrations vs. gateway/db/tables.py: upgrade from empty, no autogenerate drift, downgrade
to base and back, idempotent upgrades, any cwd, and the repo-root ``alembic`` CLI.

Every round trip also runs on a real Postgres server (the ``postgres_url`` fixture), each test in a
fresh database.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import sqlalchemy as sa
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlmodel import SQLModel

import gateway.db.tables  # noqa: F401
from gateway.db import (
    REPO_ROOT,
    alembic_config,
    current_revision,
    head_revision,
    make_engine,
    upgrade_to_head,
)
from tests.gateway.harness import fresh_postgres_db

TABLES = {
    "users",
    "api_keys",
    "sessions",
    "training_runs",
    "checkpoints",
    "sampling_sessions",
    # 0002_accounts
    "organizations",
    "quota_limits",
    "usage_buckets",
    "audit_events",
    # 0004_custom_losses
    "custom_losses",
    # 0005_request_traces
    "request_traces",
    # 0007_stability_records
    "stability_records",
}
HEAD = "0007_stability_records"


@pytest.fixture(params=["sqlite", "postgres"])
def db_url(request: pytest.FixtureRequest, tmp_path: Path):
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'mig.db'}"
        return
    yield fresh_postgres_db(request.getfixturevalue("postgres_url"))


@contextlib.contextmanager
def _migrating(url: str, revision: str):
    """(connection, alembic config) on ``url`` upgraded to ``revision`` with one user 'old'
    inserted (committed); the engine is disposed after."""
    engine = make_engine(url, foreign_keys=False)
    try:
        with engine.connect() as conn:
            cfg = alembic_config()
            cfg.attributes["connection"] = conn
            command.upgrade(cfg, revision)
            conn.exec_driver_sql(
                "INSERT INTO users (name, is_admin, created_at) VALUES ('old', false, '2025-01-01')"
            )
            conn.commit()
            yield conn, cfg
    finally:
        engine.dispose()


def _columns(url: str, table: str) -> list:
    engine = make_engine(url)
    try:
        return sa.inspect(engine).get_columns(table)
    finally:
        engine.dispose()


def _drift(url: str) -> list:
    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            ctx = MigrationContext.configure(conn, opts={"compare_type": True})
            return compare_metadata(ctx, SQLModel.metadata)
    finally:
        engine.dispose()


def _downgrade(url: str, rev: str) -> None:
    engine = make_engine(url, foreign_keys=False)
    try:
        with engine.connect() as conn:
            cfg = alembic_config()
            cfg.attributes["connection"] = conn
            command.downgrade(cfg, rev)
            conn.commit()
    finally:
        engine.dispose()


def _tables(url: str) -> set[str]:
    engine = make_engine(url)
    try:
        return set(sa.inspect(engine).get_table_names())
    finally:
        engine.dispose()


def test_upgrade_from_empty_reaches_head_with_every_table(db_url: str) -> None:
    upgrade_to_head(db_url)
    engine = make_engine(db_url)
    try:
        assert current_revision(engine) == head_revision() == HEAD
    finally:
        engine.dispose()
    assert _tables(db_url) == TABLES | {"alembic_version"}
    assert {t.name for t in SQLModel.metadata.sorted_tables} == TABLES


def test_no_drift_between_migrations_and_models(db_url: str) -> None:
    upgrade_to_head(db_url)
    assert _drift(db_url) == []


def test_drift_check_is_not_vacuous(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'mig.db'}"
    upgrade_to_head(url)
    engine = make_engine(url)
    try:
        with engine.begin() as conn:
            conn.exec_driver_sql("DROP INDEX ix_api_keys_digest")
    finally:
        engine.dispose()
    diffs = _drift(url)
    assert any(d[0] == "add_index" and d[1].name == "ix_api_keys_digest" for d in diffs), diffs


def test_downgrade_to_base_then_upgrade_again(db_url: str) -> None:
    upgrade_to_head(db_url)
    _downgrade(db_url, "base")
    assert _tables(db_url) <= {"alembic_version"}
    upgrade_to_head(db_url)
    assert _tables(db_url) == TABLES | {"alembic_version"}
    assert _drift(db_url) == []


def test_upgrade_is_idempotent_and_keeps_data(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'mig.db'}"
    upgrade_to_head(url)
    engine = make_engine(url)
    try:
        with engine.begin() as conn:
            conn.exec_driver_sql(
                "INSERT INTO users (name, is_admin, created_at) VALUES ('u', 0, '2025-01-01')"
            )
        upgrade_to_head(url)
        upgrade_to_head(engine)  # an existing engine works too
        with engine.connect() as conn:
            assert conn.exec_driver_sql("SELECT count(*) FROM users").scalar() == 1
    finally:
        engine.dispose()


def test_upgrade_works_from_any_cwd(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    url = f"sqlite:///{tmp_path / 'sub' / 'dir' / 'mig.db'}"  # parent folders are created
    upgrade_to_head(url)
    assert _tables(url) == TABLES | {"alembic_version"}


def test_sqlite_engine_pragmas(tmp_path: Path) -> None:
    engine = make_engine(f"sqlite:///{tmp_path / 'p.db'}")
    try:
        with engine.connect() as conn:
            assert conn.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
            assert conn.exec_driver_sql("PRAGMA foreign_keys").scalar() == 1
            assert conn.exec_driver_sql("PRAGMA busy_timeout").scalar() >= 5000
    finally:
        engine.dispose()


def test_foreign_keys_are_enforced_after_upgrade(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'fk.db'}"
    engine = make_engine(url)
    try:
        upgrade_to_head(engine)
        with pytest.raises(sa.exc.IntegrityError), engine.begin() as conn:
            conn.exec_driver_sql(
                "INSERT INTO api_keys (user_id, digest, prefix, scope, created_at) "
                "VALUES (999, 'd', 'p', 'user', '2025-01-01')"
            )
    finally:
        engine.dispose()


def test_alembic_cli_from_repo_root(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TWINKLE_")}
    env["TWINKLE_DATA_DIR"] = str(tmp_path / "data")
    proc = subprocess.run(
        [sys.executable, "-m", "alembic", "upgrade", "head"],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    url = f"sqlite:///{tmp_path / 'data' / 'twinkle.db'}"
    assert _tables(url) == TABLES | {"alembic_version"}
    assert _drift(url) == []


def test_in_memory_engine_can_be_migrated_and_used() -> None:
    from gateway.accounts.keys import authenticate
    from gateway.db import session_scope
    from tests.factories import create_user_and_key

    engine = make_engine("sqlite://")
    try:
        upgrade_to_head(engine)
        assert set(sa.inspect(engine).get_table_names()) == TABLES | {"alembic_version"}
        with session_scope(engine) as session:
            key = create_user_and_key(session, user_name="mem", admin=False)
        with session_scope(engine) as session:
            assert authenticate(session, key).user_name == "mem"
        with engine.connect() as conn:
            assert conn.exec_driver_sql("PRAGMA foreign_keys").scalar() == 1
    finally:
        engine.dispose()


def test_accounts_migration_moves_existing_users_into_default_org(db_url: str) -> None:
    """0001 → 0002_accounts on a database with users: they join organization "default"; the
    downgrade back to 0001 keeps them."""
    with _migrating(db_url, "0001") as (conn, cfg):
        command.upgrade(cfg, HEAD)
        conn.commit()
        row = conn.exec_driver_sql(
            "SELECT o.name FROM users u JOIN organizations o ON o.id = u.org_id"
        ).all()
        assert [r[0] for r in row] == ["default"]
        command.downgrade(cfg, "0001")
        conn.commit()
        assert conn.exec_driver_sql("SELECT count(*) FROM users").scalar() == 1
    assert "organizations" not in _tables(db_url)


def test_train_vision_migration_gives_existing_runs_false(db_url: str) -> None:
    """0002_accounts → 0003_train_vision on a database with a training run: the run reads
    train_vision false (no adapter trained a vision tower before); the downgrade drops it."""
    with _migrating(db_url, "0002_accounts") as (conn, cfg):
        conn.exec_driver_sql(
            "INSERT INTO sessions (id, user_id, tags, user_metadata, created_at, "
            "last_heartbeat_at) VALUES ('s', 1, '[]', '{}', '2025-01-01', '2025-01-01')"
        )
        conn.exec_driver_sql(
            "INSERT INTO training_runs (id, session_id, user_id, base_model, lora_rank, "
            "train_attn, train_mlp, train_unembed, seed, user_metadata, created_at, "
            "last_request_time) VALUES ('s:train:0', 's', 1, 'm', 8, true, true, true, 0, "
            "'{}', '2025-01-01', '2025-01-01')"
        )
        conn.commit()
        command.upgrade(cfg, "0003_train_vision")
        conn.commit()
        value = conn.exec_driver_sql("SELECT train_vision FROM training_runs").scalar()
        assert value in (False, 0)
        command.downgrade(cfg, "0002_accounts")
        conn.commit()
        assert conn.exec_driver_sql("SELECT count(*) FROM training_runs").scalar() == 1
    assert "train_vision" not in {c["name"] for c in _columns(db_url, "training_runs")}


def test_bigint_migration_keeps_rows_and_takes_64_bit_values(db_url: str) -> None:
    """0005 → 0006_bigint_columns on a database with a run and a checkpoint: both keep their
    values, then a seed of 2**62 and a 5 GB checkpoint size store (on Postgres both were
    'integer out of range' before)."""
    with _migrating(db_url, "0005_request_traces") as (conn, cfg):
        conn.exec_driver_sql(
            "INSERT INTO sessions (id, user_id, tags, user_metadata, created_at, "
            "last_heartbeat_at) VALUES ('s', 1, '[]', '{}', '2025-01-01', '2025-01-01')"
        )
        conn.exec_driver_sql(
            "INSERT INTO training_runs (id, session_id, user_id, base_model, lora_rank, "
            "train_attn, train_mlp, train_unembed, train_vision, seed, user_metadata, "
            "created_at, last_request_time) VALUES ('s:train:0', 's', 1, 'm', 8, true, true, "
            "true, false, 7, '{}', '2025-01-01', '2025-01-01')"
        )
        conn.exec_driver_sql(
            "INSERT INTO checkpoints (run_id, user_id, kind, name, tinker_path, storage_dir, "
            "size_bytes, public, ephemeral, user_metadata, created_at) VALUES ('s:train:0', 1, "
            "'training', 'c', 'tinker://s:train:0/weights/c', '/x', 1234, false, false, '{}', "
            "'2025-01-01')"
        )
        conn.commit()
        command.upgrade(cfg, "0006_bigint_columns")
        conn.commit()
        assert conn.exec_driver_sql("SELECT seed FROM training_runs").scalar() == 7
        assert conn.exec_driver_sql("SELECT size_bytes FROM checkpoints").scalar() == 1234
        conn.exec_driver_sql(f"UPDATE training_runs SET seed = {2**62}")
        conn.exec_driver_sql(f"UPDATE checkpoints SET size_bytes = {5 * 10**9}")
        conn.commit()
        assert conn.exec_driver_sql("SELECT seed FROM training_runs").scalar() == 2**62
        assert conn.exec_driver_sql("SELECT size_bytes FROM checkpoints").scalar() == 5 * 10**9
