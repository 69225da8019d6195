"""Liveness, readiness and graceful drain of one gateway replica, for orchestrators.

Owns: `Drain` (this replica's draining flag and its count of requests in flight),
`DrainMiddleware` (while draining, new work is answered 503 with ``Retry-After``; what lets a
client finish what it started still passes: retrieve_future, heartbeats, health and metrics), and
the probes:

* ``GET /api/v1/livez``: 200 while the process answers HTTP, draining or not (a failing liveness
  probe restarts the container; draining is not a reason to).
* ``GET /api/v1/readyz``: 200 only when every Trainer and Sampler replica of every model answers
  (their constructors load the model, so an answer means the model is loaded) and the replica is
  not draining; else 503 with the reason (an orchestrator stops routing new traffic to it).

`twinkle serve` starts the drain on SIGTERM (gateway/cli/serve.py): the replica stops taking new
work, the futures already accepted (an in-flight forward_backward) run to their end, and the
process exits 0 once they have, or after ``drain_timeout_seconds``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from gateway.deps import ConfigDep, EngineDep
from gateway.errors import error_response

if TYPE_CHECKING:  # gateway.context imports this module: the type only
    from gateway.context import AppServices

#: paths still served while draining: they finish or observe work already accepted
DRAIN_ALLOWED = (
    "/api/v1/retrieve_future",
    "/api/v1/session_heartbeat",
    "/api/v1/healthz",
    "/api/v1/livez",
    "/api/v1/readyz",
    "/api/v1/telemetry",
    "/metrics",
)
#: a replica's Trainer/Sampler must answer `info` within this to count as ready
PROBE_TIMEOUT_S = 5.0

router = APIRouter(prefix="/api/v1")


class Drain:
    """One replica's drain state. ``pending`` reports the work accepted and not finished (the
    future store's pending count), ``uncollected`` the finished results no client has retrieved
    yet; `twinkle serve` waits for the first to reach 0, then briefly for the second."""

    def __init__(
        self,
        retry_after_s: int,
        pending: Callable[[], int] = lambda: 0,
        uncollected: Callable[[], int] = lambda: 0,
    ) -> None:
        self.retry_after_s = retry_after_s
        self.pending = pending
        self.uncollected = uncollected
        self.since: float | None = None

    @property
    def draining(self) -> bool:
        return self.since is not None

    def start(self) -> None:
        if self.since is None:
            self.since = time.monotonic()

    def status(self) -> dict:
        return {
            "draining": self.draining,
            "pending": self.pending(),
            "uncollected": self.uncollected(),
        }


class DrainMiddleware:
    """503 + ``Retry-After`` for new work while the replica drains (see `DRAIN_ALLOWED`)."""

    def __init__(self, app: ASGIApp, drain: Drain) -> None:
        self.app, self.drain = app, drain

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] != "http"
            or not self.drain.draining
            or scope.get("path", "").startswith(DRAIN_ALLOWED)
        ):
            await self.app(scope, receive, send)
            return
        response = error_response(
            Request(scope),
            503,
            "draining",
            "the server is shutting down (draining): retry on another replica or after the restart",
            headers={"retry-after": str(self.drain.retry_after_s)},
        )
        await response(scope, receive, send)


@router.get("/livez")
async def livez() -> dict:
    """Liveness: the gateway process answers (also while it drains)."""
    return {"status": "alive"}


@router.get("/readyz")
async def readyz(request: Request, config: ConfigDep, engine: EngineDep) -> JSONResponse:
    """Readiness: not draining, and every model's Trainer and Sampler replicas answer."""
    services: AppServices = request.app.state.services
    drain = services.drain
    if drain.draining:
        return JSONResponse({"status": "draining", **drain.status()}, status_code=503)
    try:
        for m in config.models:
            await asyncio.wait_for(engine.every_trainer(m.name).info(), timeout=PROBE_TIMEOUT_S)
            await asyncio.wait_for(engine.every_sampler(m.name).info(), timeout=PROBE_TIMEOUT_S)
    except Exception as exc:  # a replica still loading its model, or on a node that died
        return JSONResponse({"status": "not_ready", "detail": type(exc).__name__}, status_code=503)
    return JSONResponse({"status": "ready"})
