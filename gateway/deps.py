"""FastAPI dependencies: DB session, principal, engine, future store, config, and ownership.

Ownership resolvers load a row filtered by the caller's user id and answer 404 when it is not
theirs, so ids of other tenants leak nothing.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Annotated, Any

from annotated_types import Len
from fastapi import Depends, Path, Query, Request
from pydantic import AfterValidator, StringConstraints
from sqlmodel import Session

from engine.protocol import SEED_RANGE
from gateway.accounts.keys import Principal, PrincipalDep
from gateway.config import ServerConfig
from gateway.db.tables import SamplingSessionRow, SessionRow, TrainingRunRow
from gateway.engine_client import EngineClient
from gateway.errors import GoneError, InvalidRequestError, NotFoundError
from gateway.futures.store import FutureStore
from gateway.runs.checkpoints import CHECKPOINT_DELETED
from gateway.settings import Secrets, Settings

if TYPE_CHECKING:
    from gateway.context import AppServices


def _services(request: Request) -> AppServices:
    return request.app.state.services


# The dependencies below are ``async def`` although they do no I/O: FastAPI runs a plain ``def``
# dependency in its threadpool, and a training step's four requests resolved ~20 of them (two
# thread switches each, measured in the gateway's profile on the 2-core CPU). A Session opens no
# connection until it is used.
async def get_db(request: Request) -> AsyncIterator[Session]:
    services = _services(request)
    with Session(services.db_engine) as session:
        session.info[CHECKPOINT_DELETED] = services.checkpoint_deleted
        yield session


async def get_engine(request: Request) -> EngineClient:
    return _services(request).engine


async def get_futures(request: Request) -> FutureStore:
    return _services(request).futures


async def get_config(request: Request) -> ServerConfig:
    return _services(request).config


async def get_settings(request: Request) -> Settings:
    return _services(request).settings


#: the largest integer a BIGINT column or OFFSET holds (SQLite and Postgres: signed 64-bit).
#: Offsets from a query string are bounded by it (row ids by ROW_ID_MAX below), so a larger one is
#: a 400 from validation instead of an OverflowError in the driver (a 500)
DB_INT_MAX = 2**63 - 1
#: a seed (LoRA init, sampling) on the wire: the engine's range (signed 64-bit), which the
#: training_runs.seed column holds (a larger one would be a 500: 'integer out of range' on
#: Postgres)
SEED_MIN, SEED_MAX = SEED_RANGE
#: the longest TTL a checkpoint or key may be given: 10 years (a larger one overflowed the expiry
#: datetime: an OverflowError, a 500); None means no expiry
MAX_TTL_S = 10 * 365 * 86400
#: the most a request may store as a row's ``user_metadata`` (sessions, runs, checkpoints):
#: bytes of its compact JSON. Labels and small configs fit (the SDK's are tens of bytes); more is
#: a 400, so no tenant grows the DB by megabytes per row
MAX_METADATA_BYTES = 16 * 1024
#: a session's tags: at most this many, each at most `MAX_TAG_CHARS` characters
MAX_TAGS, MAX_TAG_CHARS = 32, 128


def _bounded_metadata(value: dict[str, Any] | None) -> dict[str, Any] | None:
    if value is not None:
        size = len(json.dumps(value, separators=(",", ":"), default=str).encode())
        if size > MAX_METADATA_BYTES:
            raise ValueError(
                f"{size} bytes of JSON; at most {MAX_METADATA_BYTES} bytes may be stored"
            )
    return value


#: a request's ``user_metadata`` / ``metadata`` (bounded as above; a 400 naming the field)
UserMetadata = Annotated[dict[str, Any] | None, AfterValidator(_bounded_metadata)]
#: a session's tags on the wire
Tags = Annotated[
    list[Annotated[str, StringConstraints(max_length=MAX_TAG_CHARS)]], Len(0, MAX_TAGS)
]
#: the largest row id: id columns are INTEGER, 32-bit on Postgres (SERIAL), where comparing one
#: with a larger number is 'integer out of range' (a 500)
ROW_ID_MAX = 2**31 - 1
#: a row id in a path / an optional one in a query string, bounded as above
PathRowId = Annotated[int, Path(ge=0, le=ROW_ID_MAX)]
QueryRowId = Annotated[int | None, Query(ge=0, le=ROW_ID_MAX)]

DbDep = Annotated[Session, Depends(get_db)]
EngineDep = Annotated[EngineClient, Depends(get_engine)]
FuturesDep = Annotated[FutureStore, Depends(get_futures)]
ConfigDep = Annotated[ServerConfig, Depends(get_config)]
SettingsDep = Annotated[Settings, Depends(get_settings)]


async def get_secrets(request: Request) -> Secrets:
    return _services(request).secrets


SecretsDep = Annotated[Secrets, Depends(get_secrets)]

__all__ = ["Principal", "PrincipalDep"]


def owned_session(db: Session, who: Principal, session_id: str) -> SessionRow:
    row = db.get(SessionRow, session_id)
    if row is None or row.user_id != who.user_id:
        raise NotFoundError(f"session_id: session {session_id!r} not found")
    if row.finish_reason == "expired":  # gateway.runs.expiry: silent too long, adapters released
        from gateway.runs.expiry import expired_session_message

        raise GoneError(expired_session_message(row.id))
    if row.finished_at is not None:
        raise InvalidRequestError(
            f"session_id: session {session_id!r} was finished; create a new ServiceClient"
        )
    return row


def owned_run(db: Session, who: Principal, model_id: str, *, live: bool = False) -> TrainingRunRow:
    """The caller's run; with ``live`` (training requests) its session must not have ended: an
    ended session's adapters were released (`gateway.runs.expiry.finish_sessions`), 410."""
    row = db.get(TrainingRunRow, model_id)
    if row is None or row.user_id != who.user_id:
        raise NotFoundError(f"model_id: model {model_id!r} not found")
    session = db.get(SessionRow, row.session_id) if live else None
    if session is not None and session.finish_reason == "expired":
        from gateway.runs.expiry import expired_session_message

        raise GoneError(f"model_id: {model_id}: " + expired_session_message(session.id))
    if session is not None and session.finished_at is not None:
        raise GoneError(
            f"model_id: {model_id}: session {session.id} was finished, so its models were "
            "released (checkpoints you saved are kept); create a new ServiceClient and resume "
            "with create_training_client_from_state(<tinker:// path of a saved state>)"
        )
    return row


def owned_sampler(db: Session, who: Principal, sampler_id: str) -> SamplingSessionRow:
    row = db.get(SamplingSessionRow, sampler_id)
    if row is None or row.user_id != who.user_id:
        raise NotFoundError(f"sampling_session_id: sampler {sampler_id!r} not found")
    return row
