"""Process settings for the gateway's storage layer, read from the environment in one place.

Owns: ``TWINKLE_DATA_DIR`` (default ``./.twinkle``, made absolute), ``TWINKLE_DATABASE_URL``
(default ``sqlite:///<data_dir>/twinkle.db``) and ``TWINKLE_REDIS_URL`` (optional: futures and
idempotency keys shared by gateway replicas). Reading has no side effects: nothing is created here
(``gateway.db.make_engine`` creates the SQLite file's folder when it connects).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from pydantic import BaseModel, ConfigDict

DATA_DIR_ENV = "TWINKLE_DATA_DIR"
DATABASE_URL_ENV = "TWINKLE_DATABASE_URL"
REDIS_URL_ENV = "TWINKLE_REDIS_URL"  # futures + idempotency keys shared by gateway replicas
DEFAULT_DATA_DIR = "./.twinkle"
DB_FILENAME = "twinkle.db"


class Settings(BaseModel):
    """Resolved settings. Build with `Settings.from_env()`; construct directly in tests."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    data_dir: Path
    database_url: str
    redis_url: str | None = None

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Settings:
        """Read ``TWINKLE_DATA_DIR`` and ``TWINKLE_DATABASE_URL`` (empty values count as unset)."""
        env = os.environ if environ is None else environ
        data_dir = Path(env.get(DATA_DIR_ENV) or DEFAULT_DATA_DIR).expanduser().resolve()
        database_url = env.get(DATABASE_URL_ENV) or default_database_url(data_dir)
        redis_url = env.get(REDIS_URL_ENV) or None
        return cls(data_dir=data_dir, database_url=database_url, redis_url=redis_url)


def default_database_url(data_dir: Path) -> str:
    """``sqlite:///`` + the absolute path of ``<data_dir>/twinkle.db``."""
    return f"sqlite:///{(Path(data_dir).resolve() / DB_FILENAME).as_posix()}"
