"""The cap on a request body's size, enforced before the body is read.

Owns `BodyLimitMiddleware`: a request whose ``Content-Length`` is over
``gateway.max_request_body_mb`` is answered 413 at once, without reading it; a body without a
length (chunked) is counted as it arrives and refused with 413 as soon as it passes the cap, so
no route, decompressor or engine ever sees it. The message names the size, the cap and its config
key. Pure ASGI (no BaseHTTPMiddleware), so streaming responses are untouched.
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.errors import error_response

CONFIG_KEY = "gateway.max_request_body_mb"


class _TooLarge(Exception):
    pass


class BodyLimitMiddleware:
    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    def _message(self, size: str) -> str:
        return (
            f"body: request body of {size} is over this server's limit of {self.max_bytes} bytes "
            f"({CONFIG_KEY}); send smaller requests (split the batch)"
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            resp = error_response(
                Request(scope), 413, "too_large", self._message(f"{int(length)} bytes")
            )
            await resp(scope, receive, send)
            return
        seen = 0
        started = False

        async def counted() -> Message:
            nonlocal seen
            msg = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > self.max_bytes:
                    raise _TooLarge
            return msg

        async def tracked_send(msg: Message) -> None:
            nonlocal started
            if msg["type"] == "http.response.start":
                started = True
            await send(msg)

        try:
            await self.app(scope, counted, tracked_send)
        except _TooLarge:
            if started:  # cannot happen before the body is read; nothing left to answer
                raise
            resp = error_response(
                Request(scope), 413, "too_large", self._message(f"more than {seen} bytes")
            )
            await resp(scope, receive, send)
