"""`init_twinkle_client()` and the management calls of the native client.

Owns: base URL / key resolution (arguments, then ``TWINKLE_SERVER_URL`` / ``TWINKLE_SERVER_TOKEN``),
the HTTP transport (injectable for tests), the error hierarchy, the client's server session and
the heartbeat thread that keeps it alive, and the process-wide current client that model and
sampler classes use when none is passed.

Errors (all picklable)::

    TwinkleError                       status_code 0 (unreachable) or the HTTP status
    ├── InvalidRequestError            400 / 422: the message names the field and the rule
    ├── AuthenticationError            401
    ├── NotFoundError                  404 (also: someone else's resource)
    ├── RateLimitedError               429 after the client's own retries
    └── ServerError                    5xx
"""

from __future__ import annotations

import atexit
import contextlib
import os
import threading
import time
import weakref
from typing import Any

import httpx

from twinkle_client._version import __version__

DEFAULT_HEARTBEAT_S = 10.0
_RETRY_STATUS = (429, 503)
_MAX_RETRIES = 8


class TwinkleError(Exception):
    """A request failed. ``status_code`` is the HTTP status (0 when the server was unreachable)."""

    def __init__(self, message: str, status_code: int = 0) -> None:
        super().__init__(message, status_code)

    @property
    def message(self) -> str:
        return str(self.args[0])

    @property
    def status_code(self) -> int:
        return int(self.args[1]) if len(self.args) > 1 else 0

    def __str__(self) -> str:
        return self.message


class InvalidRequestError(TwinkleError):
    pass


class AuthenticationError(TwinkleError):
    pass


class NotFoundError(TwinkleError):
    pass


class RateLimitedError(TwinkleError):
    pass


class ServerError(TwinkleError):
    pass


def _error_for(status: int) -> type[TwinkleError]:
    if status in (400, 422):
        return InvalidRequestError
    if status == 401:
        return AuthenticationError
    if status == 404:
        return NotFoundError
    if status == 429:
        return RateLimitedError
    if status >= 500:
        return ServerError
    return TwinkleError


class TwinkleClient:
    """A connection to a Twinkle server with one server session (kept alive by heartbeats)."""

    def __init__(
        self,
        base_url: str,
        api_key: str,
        *,
        timeout: float = 600.0,
        heartbeat_interval: float | None = DEFAULT_HEARTBEAT_S,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/").removesuffix("/api/v1")
        self._http = httpx.Client(
            base_url=self.base_url,
            headers={"X-API-Key": api_key, "User-Agent": f"twinkle_client/{__version__}"},
            timeout=timeout,
            transport=transport,
        )
        self._closed = threading.Event()
        self.session_id: str = self.post("twinkle/create_session", {"client_version": __version__})[
            "session_id"
        ]
        self.heartbeats = 0
        self._hb: threading.Thread | None = None
        if heartbeat_interval:
            self._hb = threading.Thread(
                target=self._heartbeat_loop,
                args=(weakref.ref(self), float(heartbeat_interval), self._closed),
                name="twinkle-heartbeat",
                daemon=True,
            )
            self._hb.start()
        atexit.register(self.close)

    # -- transport -----------------------------------------------------------------------------
    def request(self, method: str, path: str, **kw: Any) -> httpx.Response:
        """One call to ``/api/v1/<path>``; retries 429/503 (honouring retry-after), then raises
        the `TwinkleError` subclass of the status with the server's message."""
        for attempt in range(_MAX_RETRIES + 1):
            try:
                resp = self._http.request(method, f"/api/v1/{path}", **kw)
            except httpx.HTTPError as exc:
                raise TwinkleError(f"cannot reach {self.base_url}: {exc}") from None
            if resp.status_code in _RETRY_STATUS and attempt < _MAX_RETRIES:
                wait = resp.headers.get("retry-after", "")
                time.sleep(min(float(wait) if wait.replace(".", "", 1).isdigit() else 1.0, 10.0))
                continue
            break
        if resp.status_code >= 400:
            try:
                body = resp.json()
                msg = body.get("detail") or body.get("error") or resp.text
            except ValueError:
                msg = resp.text
            raise _error_for(resp.status_code)(f"HTTP {resp.status_code}: {msg}", resp.status_code)
        return resp

    def get(self, route: str, params: dict[str, Any] | None = None) -> Any:
        return self.request("GET", route, params=params).json()

    def post(self, path: str, body: dict[str, Any]) -> Any:
        return self.request("POST", path, json=body).json()

    # -- session -------------------------------------------------------------------------------
    @staticmethod
    def _heartbeat_loop(ref: weakref.ref, interval: float, closed: threading.Event) -> None:
        while not closed.wait(interval):
            client = ref()
            if client is None:
                return
            # transient errors: the next beat retries (the server allows many misses)
            with contextlib.suppress(TwinkleError):
                client.heartbeat()
            del client

    def heartbeat(self) -> None:
        """Tell the server this session is alive (the heartbeat thread calls it periodically)."""
        self.post("twinkle/session_heartbeat", {"session_id": self.session_id})
        self.heartbeats += 1

    # -- management ----------------------------------------------------------------------------
    def health_check(self) -> bool:
        return self._http.get("/api/v1/healthz").status_code == 200

    def get_server_capabilities(self) -> dict[str, Any]:
        return self.get("twinkle/get_server_capabilities")

    def get_capacity_info(self) -> dict[str, Any]:
        return self.get("twinkle/capacity_info")

    def list_training_runs(self, limit: int = 20, offset: int = 0) -> list[dict[str, Any]]:
        return self.get("twinkle/training_runs", {"limit": limit, "offset": offset})[
            "training_runs"
        ]

    def get_training_run(self, run_id: str) -> dict[str, Any]:
        return self.get(f"twinkle/training_runs/{run_id}")

    def list_checkpoints(self, run_id: str) -> list[dict[str, Any]]:
        return self.get(f"twinkle/training_runs/{run_id}/checkpoints")["checkpoints"]

    def get_checkpoint(self, path: str) -> dict[str, Any]:
        """Metadata of a checkpoint by ``twinkle://`` (or ``tinker://``) path."""
        return self.get("twinkle/checkpoint", {"path": path})

    def delete_checkpoint(self, path: str) -> None:
        self.request("DELETE", "twinkle/checkpoint", params={"path": path})

    def get_latest_checkpoint_path(self, run_id: str) -> str | None:
        ckpts = [c for c in self.list_checkpoints(run_id) if c["checkpoint_type"] == "training"]
        return ckpts[-1]["twinkle_path"] if ckpts else None

    def download_tokenizer(self, base_model: str, dest: str | os.PathLike) -> str:
        """Fetch ``base_model``'s tokenizer files into ``dest``; returns it (load with
        `transformers.AutoTokenizer.from_pretrained(dest)` or `tokenizers.Tokenizer`)."""
        from pathlib import Path

        out = Path(dest)
        out.mkdir(parents=True, exist_ok=True)
        listing = self.get("twinkle/tokenizer", {"base_model": base_model})
        for f in listing["files"]:
            resp = self.request(
                "GET", f"twinkle/tokenizer/{f['name']}", params={"base_model": base_model}
            )
            (out / f["name"]).write_bytes(resp.content)
        return str(out)

    def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        self._http.close()

    def __enter__(self) -> TwinkleClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_current: TwinkleClient | None = None


def init_twinkle_client(
    base_url: str | None = None, api_key: str | None = None, **kw: Any
) -> TwinkleClient:
    """Connect to ``base_url`` (default ``$TWINKLE_SERVER_URL``) with ``api_key`` (default
    ``$TWINKLE_SERVER_TOKEN``), open a session kept alive by heartbeats, and make it the client
    that `MultiLoraTransformersModel` / samplers / templates use by default."""
    global _current
    url = base_url or os.environ.get("TWINKLE_SERVER_URL")
    key = api_key or os.environ.get("TWINKLE_SERVER_TOKEN")
    if not url:
        raise TwinkleError("base_url: not given and TWINKLE_SERVER_URL is not set")
    if not key:
        raise TwinkleError("api_key: not given and TWINKLE_SERVER_TOKEN is not set")
    _current = TwinkleClient(url, key, **kw)
    return _current


def get_client(client: TwinkleClient | None = None) -> TwinkleClient:
    """``client``, else the current one, else one from the environment variables."""
    if client is not None:
        return client
    if _current is None or _current._closed.is_set():
        return init_twinkle_client()
    return _current
