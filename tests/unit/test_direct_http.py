"""gateway/direct_http.py: the gateway replica's own HTTP server (no Ray Serve proxy)."""

from __future__ import annotations

import contextlib
import socket

import httpx
import pytest
from fastapi import FastAPI

from gateway.config import GatewayConfig
from gateway.direct_http import DirectHTTP, PortInUseError, check_port_free


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _app(name: str) -> FastAPI:
    app = FastAPI()

    @app.get("/who")
    async def who() -> dict:
        return {"server": name}

    return app


def test_serves_the_app_and_stops():
    port = _free_port()
    http = DirectHTTP(_app("a"), "127.0.0.1", port)
    try:
        assert http.alive()
        r = httpx.get(f"http://127.0.0.1:{port}/who", timeout=5)
        assert r.status_code == 200 and r.json() == {"server": "a"}
    finally:
        http.stop()
    assert not http.alive()
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"http://127.0.0.1:{port}/who", timeout=5)


def test_replicas_share_the_port():
    """Two gateway replicas on one node listen on the same port (SO_REUSEPORT); the kernel
    spreads new connections between them."""
    port = _free_port()
    a = DirectHTTP(_app("a"), "127.0.0.1", port)
    b = DirectHTTP(_app("b"), "127.0.0.1", port)
    try:
        seen = set()
        for _ in range(60):  # a new connection each time: all 60 on one of two is ~2^-59
            with httpx.Client(timeout=5) as c:
                seen.add(c.get(f"http://127.0.0.1:{port}/who").json()["server"])
            if seen == {"a", "b"}:
                break
        assert seen == {"a", "b"}
        a.stop()  # the other keeps serving
        assert httpx.get(f"http://127.0.0.1:{port}/who", timeout=5).json() == {"server": "b"}
    finally:
        a.stop()
        b.stop()


def test_a_port_held_by_another_process_is_refused_naming_it():
    port = _free_port()
    with socket.socket() as other:  # not SO_REUSEPORT: what any other program would hold
        other.bind(("127.0.0.1", port))
        other.listen(1)
        with pytest.raises(PortInUseError, match=f"port {port} on 127.0.0.1 is in use"):
            check_port_free("127.0.0.1", port)
        with pytest.raises(OSError):
            DirectHTTP(_app("a"), "127.0.0.1", port)
    check_port_free("127.0.0.1", port)  # free again


def test_a_failing_startup_is_raised_by_the_constructor():
    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI):
        raise RuntimeError("database unreachable")
        yield  # pragma: no cover

    port = _free_port()
    with pytest.raises(RuntimeError, match=f"127.0.0.1:{port}"):
        DirectHTTP(FastAPI(lifespan=lifespan), "127.0.0.1", port)
    check_port_free("127.0.0.1", port)  # its socket was closed


def test_auto_ingress_is_direct_for_one_replica_only():
    assert GatewayConfig().direct_ingress()
    assert not GatewayConfig(num_replicas=2, redis_url="redis://x").direct_ingress()
    assert GatewayConfig(num_replicas=2, ingress="direct").direct_ingress()
    assert not GatewayConfig(ingress="serve_proxy").direct_ingress()
