"""Prometheus metrics of one gateway app, and its ``GET /metrics`` endpoint.

Owns `GatewayMetrics` (a per-app `CollectorRegistry`, so several apps in one process, as in the
tests, never clash on the global registry), `MetricsMiddleware` (counts and times every HTTP
request) and `metrics_router` (the text exposition). The metrics:

* ``twinkle_http_requests_total{method,route,status}`` and
  ``twinkle_http_request_seconds{method,route}`` (histogram). ``route`` is the matched route
  *template* (``/api/v1/training_runs/{run_id}``), never the raw path: raw paths carry ids and
  would explode cardinality. Unmatched paths are ``unmatched``; unusual methods are ``other``.
* ``twinkle_quota_denials_total{quota,level}``: every quota / rate-limit denial (403 or 429, or a
  future failed by a quota), by quota name and level (``org`` or ``user``), fed by
  `gateway.quotas.Quotas.on_denial`.
* ``twinkle_futures_pending``: unfinished futures held by this replica.
* storage gauges read at scrape time (gateway/metrics_storage.py): ``twinkle_checkpoint_bytes``,
  ``twinkle_storage_quota_fill_ratio{level}``, ``twinkle_data_dir_free_bytes`` / ``_size_bytes``.

No label ever holds an API key, a user or org id or name, or any other caller-supplied string:
label values come from route templates, fixed method and level sets, quota names and HTTP status
codes only. Each gateway replica exposes its own numbers (scrape every replica).
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from fastapi import APIRouter, Depends, Request, Response
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.accounts.keys import get_admin_principal
from gateway.quotas.limits import QUOTAS

if TYPE_CHECKING:  # gateway.context imports this module: the type only
    from gateway.context import AppServices

UNMATCHED = "unmatched"
_CONVERTOR = re.compile(r"\{(\w+):\w+\}")
_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})
# retrieve_future long-polls up to 40 s, so the default buckets (max 10 s) would lump them all.
_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class GatewayMetrics:
    def __init__(self, pending_futures: Callable[[], int] | None = None) -> None:
        """``pending_futures()``: the gauge's value, read at scrape time."""
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "twinkle_http_requests",
            "HTTP requests answered, by method, route template and status code",
            ["method", "route", "status"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "twinkle_http_request_seconds",
            "HTTP request duration in seconds (streams: until the last byte), by route template",
            ["method", "route"],
            buckets=_BUCKETS,
            registry=self.registry,
        )
        self.quota_denials = Counter(
            "twinkle_quota_denials",
            "Quota and rate-limit denials, by quota name and level (org or user)",
            ["quota", "level"],
            registry=self.registry,
        )
        # Every (quota, level) starts at 0: a series born at its first denial would hide that
        # denial from rate() (Prometheus sees no increase from an absent sample).
        for quota in QUOTAS:
            for level in ("org", "user"):
                self.quota_denials.labels(quota, level)
        self.futures_pending = Gauge(
            "twinkle_futures_pending",
            "Unfinished futures held by this gateway replica",
            registry=self.registry,
        )
        if pending_futures is not None:
            self.futures_pending.set_function(pending_futures)

    def observe(self, method: str, route: str, status: int, seconds: float) -> None:
        method = method if method in _METHODS else "other"
        self.requests.labels(method, route, str(status)).inc()
        self.latency.labels(method, route).observe(seconds)

    def quota_denied(self, quota: str, level: str) -> None:
        self.quota_denials.labels(quota, level).inc()

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


def route_template(scope: Scope) -> str:
    """The path template of the route the router matched (FastAPI leaves it in
    ``scope["route"]``) without convertors (``{run_id:path}`` → ``{run_id}``), or
    ``unmatched``."""
    path = getattr(scope.get("route"), "path", None)
    return _CONVERTOR.sub(r"{\1}", path) if isinstance(path, str) and path else UNMATCHED


class MetricsMiddleware:
    """Counts every HTTP request once it is answered. Installed outermost, so idempotent replays
    and errors rendered by inner layers are counted with the status the client saw."""

    def __init__(self, app: ASGIApp, *, metrics: GatewayMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = 500  # an exception escaping before any response becomes a 500 further out

        async def send_(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_)
        finally:
            self.metrics.observe(
                scope["method"], route_template(scope), status, time.perf_counter() - start
            )


def metrics_router(require_admin: bool) -> APIRouter:
    """``GET /metrics``; with ``require_admin`` it needs an admin-scope key, else anyone can
    scrape it (Prometheus scrapers usually carry no key; nothing in it is secret)."""
    router = APIRouter()
    deps = [Depends(get_admin_principal)] if require_admin else []

    @router.get("/metrics", include_in_schema=False, dependencies=deps)
    def metrics(request: Request) -> Response:
        services: AppServices = request.app.state.services
        m = services.metrics
        assert m is not None  # the route exists only when metrics are enabled
        return Response(m.exposition(), media_type=CONTENT_TYPE_LATEST)

    return router
