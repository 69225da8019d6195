"""Gateway error hierarchy and its one mapping to HTTP responses.

Owns: `GatewayError` and subclasses (class attributes ``status_code`` / ``code``; no custom
``__init__``, so they pickle; the client-facing message is ``args[0]``), and
`register_exception_handlers(app)`, which renders every error the same way::

    {"error": {"code": ..., "message": ...}, "detail": message, "request_id": ...}

Gateway errors, engine errors (``engine.errors.EngineError``), request validation errors (400 naming
each field, never an empty body: the Tinker SDK retries empty 400s as a proxy rejection), Starlette
HTTP errors, the database being unreachable (503 + ``retry-after``: a restart or failover is a
retryable outage, not a server bug), and unhandled exceptions (500, logged, no internals in the
body). An engine replica lost mid-call is a 503 and a full checkpoint disk a 507, each with its
engine message (what to do). 4xx answers other
than 408/429 carry ``x-should-retry: false`` so the SDK does not retry them.

Engine messages name server files (a checkpoint's storage directory, a model's files, a full
disk's mount); `without_server_paths` turns each absolute path into ``…/<its last part>`` before
an engine error reaches any answer (the engine transport applies it to every error it passes on,
so HTTP errors, failed futures and streams all carry the redacted text; the server log keeps the
original as the error's cause).
"""

from __future__ import annotations

import logging
import math
import re
import uuid
from typing import Any, ClassVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from sqlalchemy.exc import DataError, DBAPIError, InterfaceError, OperationalError
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine.errors import AdapterNotFoundError, EngineError, ReplicaLostError, StorageFullError

log = logging.getLogger(__name__)

INTERNAL_MESSAGE = "internal server error"
#: what a client is told while the database is unreachable; retry-after is a guess at a restart
DB_UNAVAILABLE_MESSAGE = "the database is unavailable (restarting or unreachable); retry shortly"
DB_RETRY_AFTER_S = 5
#: used with ``fullmatch`` (``$`` would let a trailing newline through)
_REQUEST_ID_RE = re.compile(r"[A-Za-z0-9._:\-]{1,128}")
#: an absolute POSIX path of two or more parts, not the path part of a URL (``tinker://run/x``,
#: ``https://host/a/b``) except ``file://``; a part may hold a ``:`` but not end with one, so
#: "checkpoint /data/x: bad" stops before the colon
_PART = r"[^\s'\"`,;()\[\]{}<>/:]+(?::[^\s'\"`,;()\[\]{}<>/:]+)*"
_SERVER_PATH_RE = re.compile(rf"(?:(?<=file://)|(?<![\w.:/~-]))(?:/{_PART}){{2,}}")


def redact_paths(text: str) -> str:
    """``text`` with every absolute filesystem path replaced by ``…/<its last part>``."""
    return _SERVER_PATH_RE.sub(lambda m: "…/" + m.group(0).rsplit("/", 1)[1], text)


def without_server_paths(exc: EngineError) -> EngineError:
    """``exc`` itself when its message names no server path, else a copy of it (same class and
    attributes) whose message has them redacted (`redact_paths`)."""
    message = str(exc)
    public = redact_paths(message)
    if public == message:
        return exc
    clean = type(exc)(public)
    clean.__dict__.update(exc.__dict__)
    return clean


class GatewayError(Exception):
    """Root of gateway errors. ``str(err)`` / ``err.message`` is what the client sees."""

    status_code: ClassVar[int] = 500
    code: ClassVar[str] = "internal"
    default_message: ClassVar[str] = INTERNAL_MESSAGE

    @property
    def message(self) -> str:
        return str(self.args[0]) if self.args else self.default_message

    def __str__(self) -> str:
        return self.message

    def headers(self) -> dict[str, str]:
        """Extra response headers for this error."""
        return {}


class InvalidRequestError(GatewayError):
    status_code = 400
    code = "invalid_request"
    default_message = "invalid request"


class AuthenticationError(GatewayError):
    status_code = 401
    code = "unauthenticated"
    default_message = "missing or invalid API key"

    def headers(self) -> dict[str, str]:
        return {"www-authenticate": 'Bearer realm="twinkle"'}


class InvalidTokenError(AuthenticationError):
    """A JWT that is expired, badly signed, or whose API key was revoked: the Tinker SDK
    exchanges its key for a fresh JWT once when it sees ``error="invalid_token"``."""

    def headers(self) -> dict[str, str]:
        return {"www-authenticate": 'Bearer realm="twinkle", error="invalid_token"'}


class PermissionDeniedError(GatewayError):
    status_code = 403
    code = "permission_denied"
    default_message = "permission denied"


class NotFoundError(GatewayError):
    status_code = 404
    code = "not_found"
    default_message = "not found"


class ConflictError(GatewayError):
    status_code = 409
    code = "conflict"
    default_message = "conflict"


class GoneError(GatewayError):
    """410: the thing existed but is gone for good (an expired future, an expired download link,
    an expired session). The Tinker SDK stops a session's heartbeat on 410."""

    status_code = 410
    code = "gone"
    default_message = "gone"


class NotImplementedOnServerError(GatewayError):
    """501: a method of a client's protocol this server does not offer (e.g. upstream Twinkle's
    upload_to_hub without a hub): the message says what to do instead."""

    status_code = 501
    code = "not_implemented"
    default_message = "not implemented on this server"


class PayloadTooLargeError(GatewayError):
    """413: a request over a size cap of this server (images per request, bytes per image); the
    message names the field, the cap and its config key. Not retried by the SDK."""

    status_code = 413
    code = "too_large"
    default_message = "request too large"


class RateLimitedError(GatewayError):
    """``RateLimitedError(message, retry_after_s)``; the second arg is optional (default 1 s)."""

    status_code = 429
    code = "rate_limited"
    default_message = "rate limited, retry later"
    default_retry_after_s: ClassVar[float] = 1.0

    @property
    def retry_after_s(self) -> float:
        return float(self.args[1]) if len(self.args) > 1 else self.default_retry_after_s

    def headers(self) -> dict[str, str]:
        return {"retry-after": str(max(1, math.ceil(self.retry_after_s)))}


class QuotaExceededError(PermissionDeniedError):
    """A hard quota cap: 403 (never retried by the SDK), the message names the quota, its limit
    and the current use. ``QuotaExceededError(message, quota, limit, current)``."""

    code = "quota_exceeded"
    default_message = "quota exceeded"

    def body_extra(self) -> dict[str, Any]:
        if len(self.args) < 4:
            return {}
        return {"quota": {"name": self.args[1], "limit": self.args[2], "current": self.args[3]}}


_CODE_BY_STATUS = {
    400: "invalid_request",
    401: "unauthenticated",
    403: "permission_denied",
    404: "not_found",
    405: "method_not_allowed",
    408: "timeout",
    409: "conflict",
    410: "gone",
    413: "too_large",
    415: "unsupported_media_type",
    429: "rate_limited",
}


def request_id_for(request: Request) -> str:
    """``request.state.request_id`` if a middleware set one, else a sane ``X-Request-Id`` header,
    else a fresh uuid4 hex (remembered on ``request.state``)."""
    rid = getattr(request.state, "request_id", None)
    if isinstance(rid, str) and rid:
        return rid
    header = request.headers.get("x-request-id", "")
    rid = header if _REQUEST_ID_RE.fullmatch(header) else uuid.uuid4().hex
    request.state.request_id = rid
    return rid


def error_response(
    request: Request,
    status_code: int,
    code: str,
    message: str,
    headers: dict[str, str] | None = None,
    extra: dict[str, Any] | None = None,
) -> JSONResponse:
    """The one JSON error shape; sets ``x-should-retry: false`` on non-retryable 4xx."""
    rid = request_id_for(request)
    body: dict[str, Any] = {
        "error": {"code": code, "message": message},
        "detail": message,
        "request_id": rid,
    }
    if extra:
        body.update(extra)
    out_headers = {"x-request-id": rid, **(headers or {})}
    if 400 <= status_code < 500 and status_code not in (408, 429):
        out_headers["x-should-retry"] = "false"
    return JSONResponse(status_code=status_code, content=body, headers=out_headers)


def format_validation_errors(errors: Any) -> tuple[str, list[dict[str, Any]]]:
    """``("body.rank: Input should be a valid integer; ...", [{"loc", "msg", "type"}, ...])``.
    Input values are not echoed back."""
    parts: list[str] = []
    items: list[dict[str, Any]] = []
    for err in errors:
        loc = [str(p) for p in err.get("loc", ())]
        msg = str(err.get("msg", "invalid value"))
        field = ".".join(loc) or "request"
        parts.append(f"{field}: {msg}")
        items.append({"loc": loc, "msg": msg, "type": str(err.get("type", ""))})
    return ("; ".join(parts) or "invalid request"), items


async def _gateway_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, GatewayError)
    if exc.status_code >= 500 and not isinstance(exc, NotImplementedOnServerError):
        log.error("gateway error %s: %s", type(exc).__name__, exc.message, exc_info=exc)
    extra = exc.body_extra() if isinstance(exc, QuotaExceededError) else None
    return error_response(request, exc.status_code, exc.code, exc.message, exc.headers(), extra)


async def _engine_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, EngineError)
    if getattr(exc, "category", "server") == "user":
        if isinstance(exc, AdapterNotFoundError):
            return error_response(request, 404, "not_found", str(exc))
        return error_response(request, 400, "invalid_request", str(exc))
    if isinstance(exc, ReplicaLostError):
        log.warning("engine replica lost on %s %s", request.method, request.url.path)
        return error_response(request, 503, "unavailable", str(exc), {"retry-after": "10"})
    if isinstance(exc, StorageFullError):
        log.error("checkpoint storage full on %s %s", request.method, request.url.path)
        return error_response(request, 507, "storage_full", str(exc))
    log.error("engine error on %s %s", request.method, request.url.path, exc_info=exc)
    return error_response(request, 500, "internal", INTERNAL_MESSAGE)


def is_db_unavailable(exc: BaseException) -> bool:
    """A DB error that means "cannot reach the database" (connect refused, connection dropped
    mid-query), not a bad statement."""
    if isinstance(exc, (OperationalError, InterfaceError)):
        return True
    return isinstance(exc, DBAPIError) and bool(exc.connection_invalidated)


async def _db_error(request: Request, exc: Exception) -> JSONResponse:
    if isinstance(exc, DataError):
        # A value the database refuses (Postgres: an integer past its column, a string past its
        # length, a NUL byte in text): the request's input, not a fault. Fields are bounded on
        # the wire where we know them; this is the net for the rest, which would otherwise be a
        # 500. The driver's own message only: the statement and its parameters stay out.
        reason = str(getattr(exc, "orig", None) or type(exc).__name__).splitlines()[0][:200]
        log.info("database refused a value on %s %s: %s", request.method, request.url.path, reason)
        return error_response(
            request, 400, "invalid_request", f"a value in this request cannot be stored: {reason}"
        )
    if not is_db_unavailable(exc):
        return await _unhandled_error(request, exc)
    log.warning(  # the type only: a statement's text and parameters stay out of the log
        "database unavailable on %s %s (%s)", request.method, request.url.path, type(exc).__name__
    )
    headers = {"retry-after": str(DB_RETRY_AFTER_S)}
    return error_response(request, 503, "unavailable", DB_UNAVAILABLE_MESSAGE, headers)


async def _validation_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    message, items = format_validation_errors(exc.errors())
    return error_response(request, 400, "invalid_request", message, extra={"errors": items})


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, StarletteHTTPException)
    status = exc.status_code
    if status in (204, 304):  # no body allowed
        return Response(status_code=status, headers=exc.headers)
    message = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
    code = _CODE_BY_STATUS.get(status, "internal" if status >= 500 else "error")
    return error_response(request, status, code, message, dict(exc.headers or {}))


async def _unhandled_error(request: Request, exc: Exception) -> JSONResponse:
    log.error("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
    return error_response(request, 500, "internal", INTERNAL_MESSAGE)


def register_exception_handlers(app: FastAPI) -> None:
    """Install every handler above on ``app``."""
    app.add_exception_handler(GatewayError, _gateway_error)
    app.add_exception_handler(EngineError, _engine_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(DBAPIError, _db_error)
    app.add_exception_handler(Exception, _unhandled_error)
