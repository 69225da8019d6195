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

from gateway import admin_api, openai_api, twinkle_api
from gateway.accounts.jwt import build_jwt
from gateway.accounts.usage import UsageLedger
from gateway.body_limit import BodyLimitMiddleware
from gateway.config import ServerConfig, effective_redis_url
from gateway.db import make_engine
from gateway.engine_client import EngineClient
from gateway.errors import register_exception_handlers
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
from gateway.tinker_api import (
    checkpoints,
    compat,
    custom_losses,
    exports,
    jobs,
    retrieve,
    runs,
    sampling,
    saves,
    session_queries,
    session_search,
    session_traces,
    sessions,
    training,
)

log = logging.getLogger(__name__)


def create_app(settings: Settings, config: ServerConfig, engine_client: EngineClient) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        app.state.db_engine = make_engine(settings.database_url)
        app.state.secrets = Secrets.load(settings.data_dir)
        # With Redis (TWINKLE_REDIS_URL or gateway.redis_url), futures, idempotency keys and quota
        # state are shared by gateway replicas and survive restarts.
        redis_url = effective_redis_url(settings.redis_url, config)
        app.state.kv = make_kv(redis_url)
        app.state.futures = FutureStore(
            make_kv(redis_url),
            result_ttl_s=config.future_ttl_seconds,
            shared=redis_url is not None,
        )
        app.state.futures.job_runner = lambda job: jobs.runner(engine_client, job)
        if redis_url is not None:  # gateway replicas tell each other of dead Trainer replicas
            engine_client.share_replica_deaths(app.state.kv)
        request_log = RequestLog(app.state.db_engine)
        app.state.futures.on_finish = request_log.record
        app.state.trace_builds = {}  # session id → the task building its trace file
        await app.state.futures.start()
        app.state.quotas = build_quotas(config, app.state.db_engine, redis_url)
        if app.state.metrics is not None:
            app.state.quotas.on_denial = app.state.metrics.quota_denied
        app.state.jwt = build_jwt(
            app.state.secrets.jwt, config.gateway.jwt_enabled, config.gateway.jwt_ttl_seconds
        )
        app.state.usage = UsageLedger(app.state.db_engine)
        loop = asyncio.get_running_loop()
        app.state.checkpoint_deleted = _checkpoint_releaser(
            app.state.db_engine, app.state.quotas, loop
        )
        background = [
            loop.create_task(
                sweep_forever(
                    app.state.db_engine,
                    engine_client,
                    config,
                    app.state.quotas,
                    app.state.checkpoint_deleted,
                )
            ),
            loop.create_task(app.state.usage.run_storage_accrual()),
            loop.create_task(request_log.run_flusher()),
        ]
        try:
            yield
        finally:
            for task in background:
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task
            await app.state.futures.aclose()
            with contextlib.suppress(Exception):
                await request_log.flush()
            engine_client.share_replica_deaths(None)
            await engine_client.aclose()
            await app.state.kv.aclose()
            await app.state.quotas.aclose()
            app.state.db_engine.dispose()

    app = FastAPI(title="Twinkle", version="0.1.0", lifespan=lifespan)
    app.state.settings = settings
    app.state.server_config = config
    app.state.engine_client = engine_client
    register_exception_handlers(app)
    # Starlette wraps the last added outermost: request ids and deprecation headers around the
    # idempotent replay (which answers with the request id).
    app.add_middleware(IdempotencyKeyMiddleware, kv_getter=lambda: getattr(app.state, "kv", None))
    app.add_middleware(
        RequestHeadersMiddleware,
        deprecated_below=config.sdk_deprecated_below,
        unsupported_below=config.sdk_unsupported_below,
    )
    # While draining (SIGTERM under `twinkle serve`), new work gets 503 + Retry-After; outside
    # the request-id middleware so the 503 carries the client's request id like any error.
    app.state.drain = Drain(
        config.drain_retry_after_seconds,
        lambda: app.state.futures.pending_count() if hasattr(app.state, "futures") else 0,
        lambda: app.state.futures.uncollected_count() if hasattr(app.state, "futures") else 0,
    )
    app.add_middleware(DrainMiddleware, drain=app.state.drain)
    app.add_middleware(
        BodyLimitMiddleware, max_bytes=config.gateway.max_request_body_mb * 1024 * 1024
    )
    # Metrics are added last, so outermost: they see the status of replays and rendered errors.
    app.state.metrics = None
    if config.gateway.metrics_enabled:
        app.state.metrics = GatewayMetrics(
            lambda: app.state.futures.pending_count() if hasattr(app.state, "futures") else 0
        )
        app.state.metrics.registry.register(
            StorageCollector(
                lambda: getattr(app.state, "db_engine", None),
                settings.data_dir,
                config.gateway.default_user_quotas.get("max_checkpoint_bytes"),
            )
        )
        app.add_middleware(MetricsMiddleware, metrics=app.state.metrics)
        app.include_router(metrics_router(config.gateway.metrics_require_admin))
    # exports / checkpoints before runs: their .../{checkpoint_id:path}/publish|ttl|... routes
    # must be tried before runs' DELETE .../{checkpoint_id:path}.
    app.include_router(lifecycle_router)
    for module in (sessions, session_search, session_queries, session_traces, training):
        app.include_router(module.router)
    for module in (custom_losses, saves, exports, sampling, retrieve, compat):
        app.include_router(module.router)
    for module in (checkpoints, runs, openai_api, twinkle_api):
        app.include_router(module.router)
    for router in admin_api.routers():
        app.include_router(router)
    return app


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
