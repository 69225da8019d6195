"""Database plumbing: engine construction, programmatic Alembic upgrades, session scopes.

Owns: SQLite connection settings (WAL, ``busy_timeout``, foreign keys, cross-thread use) so that
``twinkle serve`` and a concurrent ``twinkle keys create`` can share one file; running the
migrations in ``<repo>/migrations`` without ``alembic.ini`` or a subprocess; the commit/rollback
unit of work; one upgrade at a time per database (a Postgres advisory lock, a file lock for
SQLite), and `check_at_head` for processes that must not migrate (the ``production`` profile).
The schema itself belongs to the migrations (no ``create_all`` outside tests).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import URL, make_url
from sqlalchemy.pool import StaticPool
from sqlmodel import Session

log = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parents[2]
MIGRATIONS_DIR = REPO_ROOT / "migrations"
SQLITE_BUSY_TIMEOUT_MS = 30_000


def _is_sqlite(url: URL) -> bool:
    return url.get_backend_name() == "sqlite"


def _sqlite_file(url: URL) -> Path | None:
    """The database file of a SQLite URL, or None for an in-memory database."""
    db = url.database
    if not db or db == ":memory:" or db.startswith("file:") or url.query.get("mode") == "memory":
        return None
    return Path(db)


def make_engine(url: str | URL, *, foreign_keys: bool = True, **kwargs: Any) -> Engine:
    """Create an engine. For SQLite: usable from any thread, WAL journal, ``busy_timeout``, and
    ``PRAGMA foreign_keys`` (ON unless ``foreign_keys=False``, which the migrations use) set on
    every new connection; the file's folder is created; in-memory URLs share one connection."""
    url = make_url(url)
    # Routes use the DB synchronously on the event loop, and a request may hold its session's
    # connection across an await (Redis futures, quotas). A pool checkout that blocks therefore
    # blocks the loop the holders need to finish: with SQLAlchemy's default 5 + 10 connections,
    # 50 concurrent create_model calls froze the loop until Redis connects timed out. So a
    # checkout must not wait: SQLite gets unbounded overflow (its connections are cheap files);
    # Postgres a wide pool (10 + 50 per gateway replica, under its default max_connections 100).
    if not _is_sqlite(url):
        kwargs.setdefault("pool_pre_ping", True)
        kwargs.setdefault("pool_size", 10)
        kwargs.setdefault("max_overflow", 50)
        return create_engine(url, **kwargs)

    connect_args = dict(kwargs.pop("connect_args", {}))
    connect_args.setdefault("check_same_thread", False)
    connect_args.setdefault("timeout", SQLITE_BUSY_TIMEOUT_MS / 1000)
    db_file = _sqlite_file(url)
    if db_file is None:
        kwargs.setdefault("poolclass", StaticPool)
    else:
        db_file.expanduser().parent.mkdir(parents=True, exist_ok=True)
        kwargs.setdefault("max_overflow", -1)
    engine = create_engine(url, connect_args=connect_args, **kwargs)

    @event.listens_for(engine, "connect")
    def _sqlite_pragmas(dbapi_conn: Any, _record: Any) -> None:
        cur = dbapi_conn.cursor()
        try:
            if db_file is not None:
                cur.execute("PRAGMA journal_mode=WAL")
                cur.execute("PRAGMA synchronous=NORMAL")  # safe with WAL, far fewer fsyncs
            cur.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS}")
            cur.execute(f"PRAGMA foreign_keys={'ON' if foreign_keys else 'OFF'}")
        finally:
            cur.close()

    return engine


def alembic_config(url: str | URL | None = None) -> Config:
    """An Alembic config built in code (no ``alembic.ini``), pointing at ``<repo>/migrations``.
    The URL travels in ``config.attributes["url"]`` (no ``%`` interpolation issues)."""
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    if url is not None:
        cfg.attributes["url"] = make_url(url).render_as_string(hide_password=False)
    return cfg


def head_revision() -> str | None:
    return ScriptDirectory.from_config(alembic_config()).get_current_head()


def current_revision(engine: Engine) -> str | None:
    with engine.connect() as conn:
        return MigrationContext.configure(conn).get_current_revision()


#: the Postgres advisory lock key `upgrade_to_head` holds while it migrates ("twinkle" in ASCII)
PG_MIGRATION_LOCK = 0x7477696E6B6C65


@contextlib.contextmanager
def _pg_migration_lock(engine: Engine) -> Iterator[None]:
    """Serialise concurrent upgrades of one Postgres database: a session-level advisory lock on
    a connection of its own, held until the upgrade is over (a second deploy step waits, then
    finds the database at head)."""
    with engine.connect() as conn:
        conn.exec_driver_sql(f"SELECT pg_advisory_lock({PG_MIGRATION_LOCK})")
        conn.commit()
        try:
            yield
        finally:
            conn.exec_driver_sql(f"SELECT pg_advisory_unlock({PG_MIGRATION_LOCK})")
            conn.commit()


@contextlib.contextmanager
def _migration_lock(engine: Engine) -> Iterator[None]:
    """Serialise concurrent upgrades of one database across processes: a Postgres advisory lock,
    or an advisory file lock next to a SQLite file."""
    url = engine.url
    if url.get_backend_name() == "postgresql":
        with _pg_migration_lock(engine):
            yield
        return
    db_file = _sqlite_file(url) if _is_sqlite(url) else None
    if db_file is None:
        yield
        return
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX
        yield
        return
    lock_path = db_file.expanduser().resolve().with_name(db_file.name + ".migrate.lock")
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "a+") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def upgrade_to_head(target: str | URL | Engine) -> None:
    """Run the Alembic migrations up to head (in process, from any cwd) on a URL or an existing
    engine (an engine is left open; one built here is disposed). A database already at head is
    left untouched. SQLite foreign keys are off while migrating (batch table rebuilds)."""
    owned = not isinstance(target, Engine)
    engine = make_engine(target) if owned else target
    try:
        with _migration_lock(engine):
            if current_revision(engine) == head_revision():
                return
            with engine.connect() as conn:
                sqlite = conn.dialect.name == "sqlite"
                fk_was_on = False
                if sqlite:
                    fk_was_on = bool(conn.exec_driver_sql("PRAGMA foreign_keys").scalar())
                    conn.exec_driver_sql("PRAGMA foreign_keys=OFF")
                    conn.commit()
                try:
                    cfg = alembic_config()
                    cfg.attributes["connection"] = conn
                    command.upgrade(cfg, "head")
                    conn.commit()
                finally:
                    if sqlite and fk_was_on:
                        conn.rollback()
                        conn.exec_driver_sql("PRAGMA foreign_keys=ON")
                        conn.commit()
            log.info("database migrated to %s", head_revision())
    finally:
        if owned:
            engine.dispose()


def check_at_head(target: str | URL) -> str:
    """Refuse a database that is not at the head revision (the ``production`` profile: the
    deploy runs `twinkle migrate` once, and servers and replicas only check). Returns the
    revision; raises ConfigError naming both revisions and the command to run."""
    from engine.errors import ConfigError

    engine = make_engine(target)
    try:
        current = current_revision(engine)
    finally:
        engine.dispose()
    head = head_revision()
    if current != head:
        raise ConfigError(
            f"the database is at revision {current or 'none (empty)'}, not at head {head}: run "
            "`twinkle migrate` once for this deploy (profile: production never migrates on start)"
        )
    return current or ""


@contextlib.contextmanager
def session_scope(engine: Engine) -> Iterator[Session]:
    """A SQLModel session that commits on success and rolls back on any exception.
    Objects stay readable after the commit (``expire_on_commit=False``)."""
    with Session(engine, expire_on_commit=False) as session:
        try:
            yield session
            session.commit()
        except BaseException:
            session.rollback()
            raise
