"""Process settings for the gateway's storage layer, read from the environment in one place, and
the gateway's secrets.

Owns: ``TWINKLE_DATA_DIR`` (default ``./.twinkle``, made absolute), ``TWINKLE_DATABASE_URL``
(default ``sqlite:///<data_dir>/twinkle.db``) and ``TWINKLE_REDIS_URL`` (optional: futures and
idempotency keys shared by gateway replicas). Reading settings has no side effects
(``gateway.db.make_engine`` creates the SQLite file's folder when it connects).

Secrets (`load_secret`, `Secrets`): the JWT signing secret and the URL-signing key, each from its
environment variable or else a random value kept in a 0600 file in the data dir, created once by
whichever replica comes first (the others read the same file). They are loaded once per replica at
start-up (`Secrets.load` in the app's lifespan), never per request.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
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


#: name → (environment variable, file under the data dir). The file paths are kept from earlier
#: releases, so an upgraded server keeps signing with the same secrets.
SECRETS = {
    "jwt": ("TWINKLE_JWT_SECRET", "jwt_secret"),
    "url_signing": ("TWINKLE_URL_SIGNING_KEY", "secrets/url_signing.key"),
}


def load_secret(name: str, data_dir: Path, environ: Mapping[str, str] | None = None) -> bytes:
    """The secret ``name`` (a key of `SECRETS`): its environment variable when set (required when
    gateway replicas run on hosts that share no data dir), else the file's content, which the first
    caller creates with 48 random bytes (URL-safe base64, mode 0600). Creation is race-free across
    processes: each writer writes its own temp file and hard-links it into place; the first link
    wins and everyone reads the winner."""
    env_name, rel = SECRETS[name]
    env = os.environ if environ is None else environ
    if env.get(env_name):
        return env[env_name].encode("utf-8")
    path = Path(data_dir) / rel
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write(secrets.token_urlsafe(48))
        try:
            os.link(tmp, path)
        except FileExistsError:
            pass  # another replica won: read its secret
        finally:
            tmp.unlink(missing_ok=True)
    return path.read_text().strip().encode("utf-8")


@dataclass(frozen=True)
class Secrets:
    """The secrets one gateway replica signs with, loaded once at start-up."""

    jwt: bytes
    url_signing: bytes

    @classmethod
    def load(cls, data_dir: Path, environ: Mapping[str, str] | None = None) -> Secrets:
        return cls(
            jwt=load_secret("jwt", data_dir, environ),
            url_signing=load_secret("url_signing", data_dir, environ),
        )
