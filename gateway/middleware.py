"""ASGI middleware of the gateway: request ids and SDK deprecation headers
(`RequestHeadersMiddleware`), `X-Idempotency-Key` replay (`IdempotencyKeyMiddleware`).

* Every response carries ``x-request-id`` (the same id the JSON error envelope carries).
* A POST/PUT/DELETE with ``X-Idempotency-Key`` that already succeeded (2xx) for the same caller,
  method and path is answered with the stored response (``x-idempotent-replay: true``) instead of
  running again; the same key with a different body is a 409. A duplicate that arrives while the
  first is still running waits for it, in this replica or another: the first copy claims the key
  with a set-if-absent in the shared KV (Redis ``SET NX``) before it runs. The SDK keeps one key
  across the HTTP-level retries of a call (and `copy_weights` fixes its key across every retry), so
  a retry after a lost response never runs twice. Polls (retrieve_future), heartbeats and
  telemetry are not cached. The body is buffered to hash it: one over 1 MiB (or of unknown
  length) only once the caller's key is valid; an unauthenticated one goes to the route as is.
* Tinker SDK versions (``X-Stainless-Package-Version`` or the ``User-Agent``) below
  ``sdk_deprecated_below`` get ``x-deprecation-level: warning`` and a note, below
  ``sdk_unsupported_below`` ``error``; the SDK logs both.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import re
import uuid
from collections.abc import Callable
from typing import Any

import anyio
from starlette.datastructures import Headers, MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.accounts.keys import extract_api_key
from gateway.errors import _REQUEST_ID_RE
from gateway.futures.kv import KV

IDEMPOTENCY_TTL_S = 24 * 3600.0
#: a duplicate waits this long for the first copy; its claim marker expires after it too, so a
#: replica that died mid-request blocks the key no longer than this
IDEMPOTENCY_WAIT_S = 120.0
#: how often a duplicate polls for a first copy running in another replica
_CLAIM_POLL_S = 0.05
_NOT_CACHED = ("/retrieve_future", "/session_heartbeat", "/telemetry", "/retrieve_futures")
_MAX_CACHED_BODY = 1 << 20
#: a body up to this size is buffered before its caller is authenticated (the route does that);
#: a larger one, or one of unknown length, only once the caller's key is valid
_BUFFER_BEFORE_AUTH = 1 << 20
_UA_RE = re.compile(r"Tinker/Python\s+(\d+(?:\.\d+)*)", re.I)


def parse_version(text: str | None) -> tuple[int, ...] | None:
    if not text:
        return None
    m = re.match(r"^\s*v?(\d+(?:\.\d+)*)", text)
    return tuple(int(x) for x in m.group(1).split(".")) if m else None


def sdk_version(headers: Headers) -> tuple[int, ...] | None:
    """The Tinker SDK version a request comes from, or None for other clients."""
    ua = headers.get("user-agent", "")
    m = _UA_RE.search(ua)
    if m:
        return parse_version(m.group(1))
    if "tinker" in ua.lower():
        return parse_version(headers.get("x-stainless-package-version"))
    return None


def deprecation_for(
    version: tuple[int, ...] | None, deprecated_below: str, unsupported_below: str
) -> tuple[str, str] | None:
    """(level, note) for a Tinker SDK version, or None when it is current."""
    if version is None:
        return None
    shown = ".".join(map(str, version))
    low = parse_version(unsupported_below)
    if low is not None and version < low:
        return "error", (
            f"tinker SDK {shown} is not supported by this server (oldest supported: "
            f"{unsupported_below}); upgrade with `pip install -U tinker`"
        )
    dep = parse_version(deprecated_below)
    if dep is not None and version < dep:
        return "warning", (
            f"tinker SDK {shown} is deprecated on this server and support will be removed; "
            f"upgrade to tinker>={deprecated_below}"
        )
    return None


class RequestHeadersMiddleware:
    """Gives every request an id (``x-request-id``: the client's, when well-formed, else a new
    one; error envelopes and replays carry the same) and tells old Tinker SDKs they are deprecated
    (``x-deprecation-level`` / ``x-deprecation-note``). Outermost of the two, so replays get the
    headers too."""

    def __init__(
        self, app: ASGIApp, *, deprecated_below: str = "0.0.0", unsupported_below: str = "0.0.0"
    ) -> None:
        self.app = app
        self._deprecated_below = deprecated_below
        self._unsupported_below = unsupported_below

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        rid = headers.get("x-request-id", "")
        if not _REQUEST_ID_RE.fullmatch(rid):
            rid = uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = rid
        extra = [("x-request-id", rid)]
        dep = deprecation_for(sdk_version(headers), self._deprecated_below, self._unsupported_below)
        if dep is not None:
            extra += [("x-deprecation-level", dep[0]), ("x-deprecation-note", dep[1])]

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                h = MutableHeaders(scope=message)
                for k, v in extra:
                    if k not in h:
                        h.append(k, v)
            await send(message)

        await self.app(scope, receive, send_with_headers)


async def _read_body(receive: Receive) -> bytes:
    """The whole request body (every ``http.request`` message), joined once: appending each
    chunk to the bytes so far copied 60 MiB ~1,000 times (25 s of CPU). Its size is capped by
    `gateway.body_limit.BodyLimitMiddleware`, outside this one."""
    chunks: list[bytes] = []
    more = True
    while more:
        message = await receive()
        chunks.append(message.get("body", b""))
        more = message.get("more_body", False)
    return b"".join(chunks)


def _small(headers: Headers) -> bool:
    """A body that declares at most `_BUFFER_BEFORE_AUTH` bytes."""
    length = headers.get("content-length", "")
    return length.isdigit() and int(length) <= _BUFFER_BEFORE_AUTH


class _Recorded:
    """Passes a response through to ``send`` and keeps a copy of it, to replay later copies of
    the request."""

    def __init__(self, send: Send) -> None:
        self._send = send
        self.status = 0
        self.headers: list[tuple[str, str]] = []
        self.chunks: list[bytes] = []
        self.size = 0

    async def send(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self.status = message["status"]
            self.headers = [
                (k.decode("latin-1"), v.decode("latin-1")) for k, v in message.get("headers", [])
            ]
        elif message["type"] == "http.response.body" and self.size <= _MAX_CACHED_BODY:
            chunk = message.get("body", b"")
            self.size += len(chunk)
            self.chunks.append(chunk)  # past the cap it is not cached: stop keeping it
        await self._send(message)

    def record(self, body_hash: str) -> dict | None:
        """What the KV keeps for a 2xx response up to `_MAX_CACHED_BODY` bytes; None otherwise."""
        if not (200 <= self.status < 300 and self.size <= _MAX_CACHED_BODY):
            return None
        out = b"".join(self.chunks)
        return {
            "status": self.status,
            "headers": [h for h in self.headers if h[0].lower() != "content-length"],
            "body": out.decode("latin-1"),
            "body_hash": body_hash,
        }


class IdempotencyKeyMiddleware:
    """Replays a request that already succeeded under the same ``X-Idempotency-Key`` (see the
    module docstring). Runs inside `RequestHeadersMiddleware` (it needs the request id)."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        kv_getter: Any,
        authenticates: Callable[[str | None], bool] = lambda key: True,
    ) -> None:
        """``kv_getter()`` returns the KV (built in the app's lifespan, after this is made);
        ``authenticates(key)`` (blocking: run in a thread) whether a key or JWT is valid."""
        self.app = app
        self._kv_getter = kv_getter
        self._authenticates = authenticates
        self._inflight: dict[str, asyncio.Event] = {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        key = headers.get("x-idempotency-key")
        path: str = scope["path"]
        kv: KV | None = self._kv_getter()
        if (
            not key
            or kv is None
            or scope["method"] not in ("POST", "PUT", "DELETE", "PATCH")
            or path.endswith(_NOT_CACHED)
        ):
            await self.app(scope, receive, send)
            return
        if not _small(headers) and not await anyio.to_thread.run_sync(
            self._authenticates, extract_api_key(headers)
        ):
            # not buffered for a caller who cannot use the route: it answers 401 itself
            await self.app(scope, receive, send)
            return
        await self._idempotent(scope, receive, send, headers, key, kv)

    async def _idempotent(
        self, scope: Scope, receive: Receive, send: Send, headers: Headers, key: str, kv: KV
    ) -> None:
        body = await _read_body(receive)
        caller = hashlib.sha256((extract_api_key(headers) or "").encode()).hexdigest()[:32]
        cache_key = (
            "idk:"
            + hashlib.sha256(
                f"{caller}\0{scope['method']}\0{scope['path']}\0{key}".encode()
            ).hexdigest()
        )
        body_hash = hashlib.sha256(body).hexdigest()

        claimed = await self._claim(kv, cache_key, body_hash, send, scope["state"]["request_id"])
        if not claimed:
            return  # answered: a replay of the first copy's response, or a 409
        sent = False

        async def replay_body() -> Message:
            nonlocal sent
            if sent:
                return {"type": "http.disconnect"}
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}

        response = _Recorded(send)
        stored = False
        try:
            await self.app(scope, replay_body, response.send)
            record = response.record(body_hash)
            if record is not None:
                # A plain set: this request holds the key's claim marker and replaces it.
                await kv.set(cache_key, json.dumps(record).encode(), IDEMPOTENCY_TTL_S)
                stored = True
        finally:
            if not stored:  # not cached (an error, or too big): the next copy runs again
                with contextlib.suppress(Exception):
                    await kv.delete(cache_key)
            event = self._inflight.pop(cache_key, None)
            if event is not None:
                event.set()

    async def _claim(
        self, kv: KV, cache_key: str, body_hash: str, send: Send, request_id: str
    ) -> bool:
        """Claim ``cache_key`` for this copy of the request (True: run it), or answer it from the
        first copy (False). The claim is the KV's set-if-absent of a pending marker, so it is
        atomic across gateway replicas sharing Redis; a copy that finds the marker waits (on an
        event in this replica, by polling across replicas) until the record or a release."""
        marker = json.dumps({"pending": True, "body_hash": body_hash}).encode()
        while True:
            if await kv.set(cache_key, marker, IDEMPOTENCY_WAIT_S, only_new=True):
                self._inflight[cache_key] = asyncio.Event()
                return True
            cached = await kv.get(cache_key)
            if cached is None:
                continue  # released (the first copy failed) between the two calls: claim again
            record = json.loads(cached)
            if not record.get("pending") or record["body_hash"] != body_hash:
                await self._replay(send, record, body_hash, request_id)
                return False
            # Still running. The marker expires after IDEMPOTENCY_WAIT_S, so this ends even if
            # the first copy's replica died.
            waiter = self._inflight.get(cache_key)
            if waiter is None:  # the first copy runs in another replica: poll
                await asyncio.sleep(_CLAIM_POLL_S)
                continue
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(waiter.wait(), IDEMPOTENCY_WAIT_S)

    @staticmethod
    async def _replay(send: Send, record: dict, body_hash: str, request_id: str) -> None:
        if record["body_hash"] != body_hash:
            body = json.dumps(
                {
                    "error": {
                        "code": "conflict",
                        "message": "X-Idempotency-Key was already used for a different request "
                        "body; use a new key for a new request",
                    },
                    "detail": "X-Idempotency-Key reused with a different request body",
                    "request_id": request_id,
                }
            ).encode()
            await send(
                {
                    "type": "http.response.start",
                    "status": 409,
                    "headers": [
                        (b"content-type", b"application/json"),
                        (b"x-should-retry", b"false"),
                        (b"content-length", str(len(body)).encode()),
                    ],
                }
            )
            await send({"type": "http.response.body", "body": body})
            return
        body = record["body"].encode("latin-1")
        hdrs = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in record["headers"]]
        hdrs += [
            (b"content-length", str(len(body)).encode()),
            (b"x-idempotent-replay", b"true"),
        ]
        await send({"type": "http.response.start", "status": record["status"], "headers": hdrs})
        await send({"type": "http.response.body", "body": body})
