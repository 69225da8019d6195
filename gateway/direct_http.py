"""Serving the gateway's ASGI app straight from its Ray Serve replica, without Serve's proxy.

Owns: `DirectHTTP` (a uvicorn server on a thread of its own with its own event loop, on a socket
bound with ``SO_REUSEPORT`` so that every gateway replica on the head node listens on the same
port and the kernel spreads connections between them) and `check_port_free`.

Why: behind Serve's proxy every request crosses one more process (the proxy's uvicorn, then an
actor call carrying the ASGI messages to the replica and back). Measured on the 2-core CPU
(benchmarks/README.md, ``service_path.py``): a bare ``GET /api/v1/livez`` took 4-9 ms through the
proxy and 1.5-2 ms served by the replica itself, and a training step makes four requests (two
submissions, two long polls), two of them on the step's critical path, while the proxy's CPU is
taken from the Trainer's cores. ``gateway.ingress: serve_proxy`` routes through the proxy instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import socket
import threading
import time
from typing import Any

#: Serve's proxy keeps idle client connections this long (ray.serve's default); so do we, so an
#: SDK's pooled connection is not closed between two steps of a slow model
KEEP_ALIVE_S = 90
#: how long a replica waits for its server to listen (start-up runs the app's lifespan: the
#: future store's lease, the request-log flusher; milliseconds in practice)
START_TIMEOUT_S = 60.0


class PortInUseError(RuntimeError):
    pass


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def check_port_free(host: str, port: int) -> None:
    """Raise `PortInUseError` (naming the address) if nothing of ours could listen on it; our own
    replicas share the port through SO_REUSEPORT, so this runs before any of them starts."""
    with socket.socket(_family(host), socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise PortInUseError(
                    f"port {port} on {host} is in use by another process; stop it or pick "
                    "another port (--port, or `port:` in the config)"
                ) from None
            raise PortInUseError(f"cannot listen on {host}:{port}: {exc.strerror}") from None


def _bind(host: str, port: int) -> socket.socket:
    sock = socket.socket(_family(host), socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
        sock.listen(2048)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock


class DirectHTTP:
    """``app`` served on ``host:port`` by uvicorn on a daemon thread. The constructor returns
    once the server listens (its lifespan started) or raises what stopped it."""

    def __init__(self, app: Any, host: str, port: int) -> None:
        import uvicorn

        self.address = f"{host}:{port}"
        self._sock = _bind(host, port)
        config = uvicorn.Config(
            app,
            lifespan="on",
            log_level="warning",
            access_log=False,
            timeout_keep_alive=KEEP_ALIVE_S,
        )
        self._server = uvicorn.Server(config)
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="gateway-http", daemon=True)
        self._thread.start()
        self._wait_started()

    def _run(self) -> None:
        try:
            asyncio.run(self._server.serve(sockets=[self._sock]))
        except BaseException as exc:  # reported by alive() / the constructor
            self._error = exc
        finally:
            with contextlib.suppress(OSError):
                self._sock.close()

    def _wait_started(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self._server.started:
            if not self._thread.is_alive():
                # a failed lifespan start-up returns without raising (uvicorn logged why)
                why = f": {self._error!r}" if self._error is not None else " (see the log above)"
                raise RuntimeError(
                    f"the gateway's HTTP server on {self.address} stopped while starting{why}"
                )
            if time.monotonic() > deadline:
                raise RuntimeError(f"the gateway's HTTP server on {self.address} did not start")
            self._thread.join(0.01)

    def alive(self) -> bool:
        return self._thread.is_alive() and not self._server.should_exit

    def stop(self, timeout: float = 5.0) -> None:
        """Stop accepting, finish open responses (uvicorn's graceful exit), close the socket."""
        self._server.should_exit = True
        self._thread.join(timeout)
