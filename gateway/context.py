"""The gateway's services and the one request context every dialect's routes use.

Owns: `AppServices` (everything the app runs on, built once in the lifespan by
`gateway.main`, read back with `services_of` / `ServicesDep`), and `RequestContext` with its
FastAPI dependency `ContextDep` (who calls, their DB session, the services, and the client
session the request is bound to where the dialect knows one).

Modules below the dialects (accounts, quotas, deps) read ``request.app.state.services`` with this
type under ``TYPE_CHECKING``: importing this module from them would be a cycle (it imports them).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Annotated

from fastapi import Depends, FastAPI, Request
from sqlalchemy import Engine
from sqlmodel import Session

from gateway.accounts.jwt import JwtIssuer
from gateway.accounts.keys import Principal, PrincipalDep
from gateway.accounts.usage import UsageLedger
from gateway.config import ServerConfig
from gateway.deps import DbDep
from gateway.engine_client import EngineClient
from gateway.futures.held import HeldLedger
from gateway.futures.kv import KV
from gateway.futures.store import FutureStore
from gateway.lifecycle import Drain
from gateway.metrics import GatewayMetrics
from gateway.quotas import Quotas
from gateway.runs.request_log import RequestLog
from gateway.settings import Secrets, Settings


@dataclass
class AppServices:
    """What the app runs on, built once per app in its lifespan."""

    settings: Settings
    config: ServerConfig
    engine: EngineClient
    db_engine: Engine
    secrets: Secrets
    #: futures, idempotency keys, native model records, sampler templates (Redis when shared)
    kv: KV
    futures: FutureStore
    quotas: Quotas
    usage: UsageLedger
    request_log: RequestLog
    #: None unless gateway.jwt_enabled
    jwt: JwtIssuer | None
    #: gives a deleted checkpoint's count and bytes back to its owner's quotas
    checkpoint_deleted: Callable[[int, str], None]
    drain: Drain
    #: what each user's unfinished sequenced requests hold in this replica (count, bytes)
    held: HeldLedger
    #: None unless gateway.metrics_enabled
    metrics: GatewayMetrics | None = None
    #: session id → the task building its trace file
    trace_builds: dict[str, asyncio.Task] = field(default_factory=dict)


def running_services(app: FastAPI) -> AppServices | None:
    """The app's services, or None before its lifespan started (middleware built earlier)."""
    return getattr(app.state, "services", None)


def services_of(app: FastAPI) -> AppServices:
    services = running_services(app)
    if services is None:
        raise RuntimeError("the app's lifespan has not started: no services yet")
    return services


async def get_services(request: Request) -> AppServices:
    return services_of(request.app)


ServicesDep = Annotated[AppServices, Depends(get_services)]


@dataclass
class RequestContext:
    """One request's caller, DB session and services; ``session_id`` is the client session the
    request is bound to (a native model's or sampler's session), None where the dialect names
    none in the request itself."""

    who: Principal
    db: Session
    services: AppServices
    session_id: str | None = None

    @property
    def engine(self) -> EngineClient:
        return self.services.engine

    @property
    def futures(self) -> FutureStore:
        return self.services.futures

    @property
    def quotas(self) -> Quotas:
        return self.services.quotas

    @property
    def usage(self) -> UsageLedger:
        return self.services.usage

    @property
    def settings(self) -> Settings:
        return self.services.settings

    @property
    def config(self) -> ServerConfig:
        return self.services.config

    @property
    def kv(self) -> KV:
        return self.services.kv

    def in_session(self, session_id: str) -> RequestContext:
        return replace(self, session_id=session_id)


# async: FastAPI runs a plain ``def`` dependency in its threadpool (see gateway/deps.py)
async def get_context(who: PrincipalDep, db: DbDep, services: ServicesDep) -> RequestContext:
    return RequestContext(who, db, services)


ContextDep = Annotated[RequestContext, Depends(get_context)]
