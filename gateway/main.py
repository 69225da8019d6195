"""create_app(): the gateway's FastAPI application, wired to an engine client.

The DB engine and the future store are built in the lifespan (not at import), so tests and Ray
Serve replicas control them. The engine client is passed in: Ray Serve handles under `twinkle serve`,
in-process engine objects in tests.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI

from engine.config import ServerConfig
from gateway import openai_api, twinkle_api
from gateway.db import make_engine
from gateway.engine_client import EngineClient
from gateway.errors import register_exception_handlers
from gateway.futures import FutureStore
from gateway.settings import Settings
from gateway.tinker_api import futures, runs, sampling, sessions, training

log = logging.getLogger(__name__)


def create_app(settings: Settings, config: ServerConfig, engine_client: EngineClient) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        app.state.db_engine = make_engine(settings.database_url)
        app.state.futures = FutureStore()
        try:
            yield
        finally:
            await app.state.futures.aclose()
            app.state.db_engine.dispose()

    app = FastAPI(title="Twinkle", version="0.1.0", lifespan=lifespan)
    app.state.settings = settings
    app.state.server_config = config
    app.state.engine_client = engine_client
    register_exception_handlers(app)
    for module in (sessions, training, sampling, futures, runs, openai_api, twinkle_api):
        app.include_router(module.router)
    return app
