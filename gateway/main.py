"""create_app(): the gateway's FastAPI application, wired to an engine client.

The DB engine, the future store and the secrets are built in the lifespan (not at import), so
tests and Ray Serve replicas control them. The engine client is passed in: Ray Serve handles under
`twinkle serve`, in-process engine objects in tests.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI

from gateway import admin_api, openai_api, tinker_api, twinkle_api
from gateway.accounts.jwt import build_jwt
from gateway.accounts.keys import authenticate_engine
from gateway.accounts.usage import UsageLedger
from gateway.body_limit import BodyLimitMiddleware
from gateway.config import ServerConfig, effective_redis_url
from gateway.context import AppServices, running_services
from gateway.db import make_engine
from gateway.engine_client import EngineClient
from gateway.errors import AuthenticationError, register_exception_handlers
from gateway.futures.held import HeldLedger
from gateway.futures.kv import make_kv
from gateway.futures.store import FutureStore
from gateway.lifecycle import Drain, DrainMiddleware
from gateway.lifecycle import router as lifecycle_router
from gateway.metrics import GatewayMetrics, MetricsMiddleware, metrics_router
from gateway.metrics_storage import StorageCollector
from gateway.middleware import IdempotencyKeyMiddleware, RequestHeadersMiddleware
from gateway.quotas import build_quotas
from gateway.runs.expiry import sweep_forever
from gateway.runs.request_log import RequestLog
from gateway.settings import Secrets, Settings
from gateway.tinker_api import jobs

log = logging.getLogger(__name__)


def create_app(settings: Settings, config: ServerConfig, engine_client: EngineClient) -> FastAPI:
    """The app: services built in its lifespan (`build_services`), middleware, routers."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        services = build_services(settings, config, engine_client, drain, metrics)
        app.state.services = services
        async with _running(services):
            yield

    app = FastAPI(title="Twinkle", version="0.1.0", lifespan=lifespan)
    register_exception_handlers(app)
    drain = _drain(app, config)
    # `twinkle serve` (gateway/cli/serve.py) starts the drain on SIGTERM through app.state
    app.state.drain = drain
    metrics = _add_middleware(app, settings, config, drain)
    _include_routers(app, config)
    return app


def build_services(
    settings: Settings,
    config: ServerConfig,
    engine_client: EngineClient,
    drain: Drain,
    metrics: GatewayMetrics | None,
) -> AppServices:
    """Everything the app runs on. With Redis (TWINKLE_REDIS_URL or gateway.redis_url), futures,
    idempotency keys and quota state are shared by gateway replicas and survive restarts."""
    db_engine = make_engine(settings.database_url)
    secrets = Secrets.load(settings.data_dir)
    redis_url = effective_redis_url(settings.redis_url, config)
    futures = FutureStore(
        make_kv(redis_url), result_ttl_s=config.future_ttl_seconds, shared=redis_url is not None
    )
    futures.job_runner = lambda job: jobs.runner(engine_client, job)
    request_log = RequestLog(db_engine)
    futures.on_finish = request_log.record
    quotas = build_quotas(config, db_engine, redis_url)
    if metrics is not None:
        quotas.on_denial = metrics.quota_denied
    kv = make_kv(redis_url)
    if redis_url is not None:  # gateway replicas tell each other of dead Trainer replicas
        engine_client.share_replica_deaths(kv)
    return AppServices(
        settings=settings,
        config=config,
        engine=engine_client,
        db_engine=db_engine,
        secrets=secrets,
        kv=kv,
        futures=futures,
        quotas=quotas,
        usage=UsageLedger(db_engine),
        request_log=request_log,
        jwt=build_jwt(secrets.jwt, config.gateway.jwt_enabled, config.gateway.jwt_ttl_seconds),
        checkpoint_deleted=_checkpoint_releaser(db_engine, quotas, asyncio.get_running_loop()),
        drain=drain,
        held=HeldLedger(
            config.gateway.max_held_mb_per_user * 2**20,
            config.gateway.max_pending_sequenced_per_user,
        ),
        metrics=metrics,
    )


@asynccontextmanager
async def _running(s: AppServices) -> AsyncIterator[None]:
    """The services' background work (expiry sweep, storage accrual, request-log flush) while
    the app serves; everything closed in order after."""
    await s.futures.start()
    loop = asyncio.get_running_loop()
    background = [
        loop.create_task(
            sweep_forever(s.db_engine, s.engine, s.config, s.quotas, s.checkpoint_deleted)
        ),
        loop.create_task(s.usage.run_storage_accrual()),
        loop.create_task(s.request_log.run_flusher()),
    ]
    try:
        yield
    finally:
        for task in background:
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
        await s.futures.aclose()
        with contextlib.suppress(Exception):
            await s.request_log.flush()
        s.engine.share_replica_deaths(None)
        await s.engine.aclose()
        await s.kv.aclose()
        await s.quotas.aclose()
        s.db_engine.dispose()


def _pending(app: FastAPI) -> int:
    s = running_services(app)
    return s.futures.pending_count() if s is not None else 0


def _uncollected(app: FastAPI) -> int:
    s = running_services(app)
    return s.futures.uncollected_count() if s is not None else 0


def _drain(app: FastAPI, config: ServerConfig) -> Drain:
    return Drain(config.drain_retry_after_seconds, lambda: _pending(app), lambda: _uncollected(app))


def _add_middleware(
    app: FastAPI, settings: Settings, config: ServerConfig, drain: Drain
) -> GatewayMetrics | None:
    """The middleware stack, innermost first; the metrics it reports to, if enabled."""
    # Starlette wraps the last added outermost: request ids and deprecation headers around the
    # idempotent replay (which answers with the request id).
    app.add_middleware(
        IdempotencyKeyMiddleware,
        kv_getter=lambda: s.kv if (s := running_services(app)) is not None else None,
        authenticates=lambda key: _authenticates(app, key),
    )
    app.add_middleware(
        RequestHeadersMiddleware,
        deprecated_below=config.sdk_deprecated_below,
        unsupported_below=config.sdk_unsupported_below,
    )
    # While draining (SIGTERM under `twinkle serve`), new work gets 503 + Retry-After; outside
    # the request-id middleware so the 503 carries the client's request id like any error.
    app.add_middleware(DrainMiddleware, drain=drain)
    app.add_middleware(
        BodyLimitMiddleware, max_bytes=config.gateway.max_request_body_mb * 1024 * 1024
    )
    if not config.gateway.metrics_enabled:
        return None
    # Metrics are added last, so outermost: they see the status of replays and rendered errors.
    metrics = GatewayMetrics(lambda: _pending(app))
    metrics.registry.register(
        StorageCollector(
            lambda: s.db_engine if (s := running_services(app)) is not None else None,
            settings.data_dir,
            config.gateway.default_user_quotas.get("max_checkpoint_bytes"),
        )
    )
    app.add_middleware(MetricsMiddleware, metrics=metrics)
    return metrics


def _authenticates(app: FastAPI, raw_key: str | None) -> bool:
    """Whether ``raw_key`` (an API key or JWT) is valid now (blocking: a DB read)."""
    s = running_services(app)
    if s is None:
        return False
    try:
        authenticate_engine(s.db_engine, raw_key, s.jwt.verify if s.jwt is not None else None)
    except AuthenticationError:
        return False
    return True


def _include_routers(app: FastAPI, config: ServerConfig) -> None:
    if config.gateway.metrics_enabled:
        app.include_router(metrics_router(config.gateway.metrics_require_admin))
    app.include_router(lifecycle_router)
    for dialect in (tinker_api, openai_api, twinkle_api, admin_api):
        app.include_router(dialect.router)


def _checkpoint_releaser(db_engine, quotas, loop: asyncio.AbstractEventLoop):
    """The callback that gives a deleted checkpoint's count and bytes back to its owner's (and
    org's) quotas (see gateway/checkpoints.CHECKPOINT_DELETED). Deletion happens in sync code, so
    the release runs as a task; ``pending`` keeps the tasks referenced until they finish."""
    pending: set[asyncio.Task] = set()

    async def release(user_id: int, path: str) -> None:
        from sqlmodel import Session

        from gateway.db.tables import UserRow

        with Session(db_engine) as s:
            user = s.get(UserRow, user_id)
            org_id = user.org_id if user is not None else None
        await quotas.release_checkpoint(user_id, org_id, path)

    def hook(user_id: int, path: str) -> None:
        task = loop.create_task(release(user_id, path))
        pending.add(task)
        task.add_done_callback(pending.discard)

    return hook
