"""Alembic environment for Twinkle.

Target metadata: ``SQLModel.metadata`` from ``gateway.db.tables``.

Owns how a migration run finds its database: a connection handed over by
``gateway.db.upgrade_to_head`` (``config.attributes["connection"]``), else ``attributes["url"]``,
else ``sqlalchemy.url`` from an ini file, else ``gateway.settings.Settings.from_env()`` (so
``alembic upgrade head`` at the repo root honours ``TWINKLE_DATABASE_URL`` / ``TWINKLE_DATA_DIR``).
SQLite runs in batch mode (``render_as_batch``) with foreign keys off.
"""

from __future__ import annotations

import logging.config
import sys
from pathlib import Path
from typing import Any

from alembic import context
from sqlmodel import SQLModel

_REPO_ROOT = Path(__file__).resolve().parent.parent
if str(_REPO_ROOT) not in sys.path:  # `alembic` run from the repo root without an install
    sys.path.insert(0, str(_REPO_ROOT))

import gateway.db.tables  # noqa: E402,F401  (registers every table on SQLModel.metadata)
from gateway.db import make_engine  # noqa: E402
from gateway.settings import Settings  # noqa: E402

config = context.config
if config.config_file_name is not None and config.file_config.has_section("formatters"):
    logging.config.fileConfig(config.config_file_name, disable_existing_loggers=False)

target_metadata = SQLModel.metadata


def _url() -> str:
    return (
        config.attributes.get("url")
        or config.get_main_option("sqlalchemy.url")
        or Settings.from_env().database_url
    )


def _configure(**kw: Any) -> None:
    dialect = kw.pop("dialect_name")
    context.configure(
        target_metadata=target_metadata,
        render_as_batch=dialect == "sqlite",
        compare_type=True,
        **kw,
    )


def run_migrations_offline() -> None:
    url = _url()
    from sqlalchemy.engine import make_url

    _configure(
        url=url,
        dialect_name=make_url(url).get_backend_name(),
        literal_binds=True,
        dialect_opts={"paramstyle": "named"},
    )
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        _configure(connection=connection, dialect_name=connection.dialect.name)
        with context.begin_transaction():
            context.run_migrations()
        return

    engine = make_engine(_url(), foreign_keys=False)
    try:
        with engine.connect() as connection:
            _configure(connection=connection, dialect_name=connection.dialect.name)
            with context.begin_transaction():
                context.run_migrations()
            connection.commit()
    finally:
        engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
