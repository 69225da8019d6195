"""`init_twinkle_client()`, the HTTP layer and the management calls of the native client.

Owns: base URL / key resolution (arguments, then ``TWINKLE_SERVER_URL`` / ``TWINKLE_SERVER_TOKEN``,
then a local quick-start server's file: local_server.py; ``/api/v1`` is appended unless present),
the headers upstream Twinkle's client sends on every request (both auth headers, the session id once
a session exists, and one routing id per process in ``x-request-id`` / ``X-Ray-Serve-Request-Id`` /
``serve_multiplexed_model_id`` / ``Serve-Multiplexed-Model-Id``), retries of 429/503, the error
hierarchy, the server session with its heartbeat thread, and the process-wide current client that
models and samplers use when none is passed.

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
import uuid
import weakref
from datetime import datetime
from typing import Any
from urllib.parse import quote

import httpx

from twinkle_client import local_server
from twinkle_client import types as t
from twinkle_client._version import __version__

DEFAULT_HEARTBEAT_S = 10
_RETRY_STATUS = (429, 503)
_MAX_RETRIES = 8
#: one routing id per process (upstream: ``<timestamp>-<8 hex>``), for sticky replica routing
REQUEST_ID = datetime.now().strftime("%Y%m%d_%H%M%S") + "-" + uuid.uuid4().hex[:8]
ROUTING_HEADERS = (
    "x-request-id",
    "X-Ray-Serve-Request-Id",
    "serve_multiplexed_model_id",
    "Serve-Multiplexed-Model-Id",
)
SESSION_HEADER = "X-Twinkle-Session-Id"


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


#: upstream's name for the management errors
TwinkleClientError = TwinkleError


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


def api_base(url: str) -> str:
    """``url`` without a trailing slash, ending in ``/api/v1``."""
    url = url.rstrip("/")
    return url if url.endswith("/api/v1") else url + "/api/v1"


class TwinkleClient:
    """A connection to a Twinkle server with one server session (kept alive by heartbeats)."""

    def __init__(
        self,
        base_url: str | None = None,
        api_key: str | None = None,
        route_prefix: str | None = "/twinkle",
        session_heartbeat_interval: float | None = DEFAULT_HEARTBEAT_S,
        session_metadata: dict[str, Any] | None = None,
        *,
        timeout: float = 600.0,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        url, key = local_server.resolve(
            base_url or os.environ.get("TWINKLE_SERVER_URL"),
            api_key or os.environ.get("TWINKLE_SERVER_TOKEN"),
        )
        if not url:
            raise TwinkleError(
                "base_url: not given, TWINKLE_SERVER_URL is not set and no local quick-start "
                f"server was found ({local_server.quickstart_file()})"
            )
        if not key:
            raise TwinkleError("api_key: not given and TWINKLE_SERVER_TOKEN is not set")
        self.base_url = api_base(url)
        self.api_key = key
        self.route_prefix = (route_prefix or "").rstrip("/")
        headers: dict[str, str] = dict.fromkeys(ROUTING_HEADERS, REQUEST_ID)
        headers["Authorization"] = headers["Twinkle-Authorization"] = f"Bearer {key}"
        headers["User-Agent"] = f"twinkle_client/{__version__}"
        self._http = httpx.Client(
            base_url=self.base_url, headers=headers, timeout=timeout, transport=transport
        )
        self._closed = threading.Event()
        self.session_id: str = self.create_session(session_metadata)
        self._http.headers[SESSION_HEADER] = self.session_id
        self.heartbeats = 0
        self._hb: threading.Thread | None = None
        if session_heartbeat_interval:
            self._hb = threading.Thread(
                target=self._heartbeat_loop,
                args=(weakref.ref(self), float(session_heartbeat_interval), self._closed),
                name="TwinkleSessionHeartbeat",
                daemon=True,
            )
            self._hb.start()
        atexit.register(self.close)

    # -- transport -----------------------------------------------------------------------------
    def request(self, method: str, path: str, **kw: Any) -> httpx.Response:
        """One call to ``<base_url>/<path>``; retries 429/503 (honouring retry-after), then raises
        the `TwinkleError` subclass of the status with the server's message."""
        for attempt in range(_MAX_RETRIES + 1):
            try:
                resp = self._http.request(method, "/" + path.lstrip("/"), **kw)
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
            except (ValueError, AttributeError):
                msg = resp.text
            raise _error_for(resp.status_code)(f"HTTP {resp.status_code}: {msg}", resp.status_code)
        return resp

    def get(self, path: str, params: dict[str, Any] | None = None) -> Any:
        return self.request("GET", path, params=params).json()

    def post(self, path: str, body: dict[str, Any] | None = None) -> Any:
        return self.request("POST", path, json={} if body is None else body).json()

    def _mgmt(self, endpoint: str) -> str:
        return f"{self.route_prefix}/{endpoint}".lstrip("/")

    # -- session -------------------------------------------------------------------------------
    def create_session(self, metadata: dict[str, Any] | None = None) -> str:
        body = {"metadata": metadata, "client_version": __version__}
        return str(self.post(self._mgmt("create_session"), body)["session_id"])

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
        self.post(self._mgmt("session_heartbeat"), {"session_id": self.session_id})
        self.heartbeats += 1

    # -- management (upstream's TwinkleClient methods) ------------------------------------------
    def health_check(self) -> bool:
        try:
            return self._http.get("/healthz").status_code == 200
        except httpx.HTTPError:
            return False

    def get_server_capabilities(self) -> t.GetServerCapabilitiesResponse:
        return t.GetServerCapabilitiesResponse(**self.get(self._mgmt("get_server_capabilities")))

    def get_capacity_info(self) -> t.CapacityInfoResponse:
        return t.CapacityInfoResponse(**self.get(self._mgmt("capacity_info")))

    def list_training_runs_with_cursor(
        self, limit: int = 20, offset: int = 0, all_users: bool = False
    ) -> tuple[list[t.TrainingRun], t.Cursor]:
        params: dict[str, Any] = {"limit": limit, "offset": offset}
        if all_users:
            params["access_scope"] = "accessible"
        data = self.get(self._mgmt("training_runs"), params)
        runs = [t.TrainingRun(**r) for r in data.get("training_runs", [])]
        return runs, t.Cursor(**(data.get("cursor") or {}))

    def list_training_runs(
        self, limit: int = 20, offset: int = 0, all_users: bool = False
    ) -> list[t.TrainingRun]:
        return self.list_training_runs_with_cursor(limit, offset, all_users)[0]

    def get_training_run(self, run_id: str) -> t.TrainingRun:
        return t.TrainingRun(**self.get(self._mgmt(f"training_runs/{run_id}")))

    def find_training_run_by_model(self, base_model: str) -> list[t.TrainingRun]:
        return [r for r in self.list_training_runs(limit=100) if r.base_model == base_model]

    def list_checkpoints(self, run_id: str) -> list[t.Checkpoint]:
        data = self.get(self._mgmt(f"training_runs/{run_id}/checkpoints"))
        return [t.Checkpoint(**c) for c in data.get("checkpoints", [])]

    def get_checkpoint(self, path: str) -> t.Checkpoint:
        """A checkpoint by ``twinkle://`` (or ``tinker://``) path."""
        path = getattr(path, "twinkle_path", path)  # a SaveResponse stands for its path
        return t.Checkpoint(**self.get(self._mgmt("checkpoint"), {"path": path}))

    def get_checkpoint_twinkle_path(self, run_id: str, checkpoint_id: str) -> str:
        return f"twinkle://{run_id}/{checkpoint_id}"

    def get_checkpoint_path(self, run_id: str, checkpoint_id: str) -> t.ParsedCheckpointTwinklePath:
        """The checkpoint's paths (checked on the server). Checkpoints live on the server, so
        ``path`` is the ``twinkle://`` path too (upstream: a server directory)."""
        path = self.get_checkpoint_twinkle_path(run_id, checkpoint_id)
        ckpt = self.get_checkpoint(path)
        return t.ParsedCheckpointTwinklePath(
            path=ckpt.twinkle_path,
            twinkle_path=ckpt.twinkle_path,
            training_run_id=run_id,
            checkpoint_type=checkpoint_id.split("/")[0] if "/" in checkpoint_id else "",
            checkpoint_id=checkpoint_id,
        )

    def get_weights_info(self, twinkle_path: str) -> t.WeightsInfoResponse:
        """The run behind a checkpoint path: base model, owner, LoRA rank."""
        path = getattr(twinkle_path, "twinkle_path", twinkle_path)
        run_id = self.get(self._mgmt("checkpoint"), {"path": path})["run_id"]
        run = self.get_training_run(run_id)
        return t.WeightsInfoResponse(
            training_run_id=run.training_run_id,
            base_model=run.base_model,
            model_owner=run.model_owner,
            is_lora=run.is_lora,
            lora_rank=run.lora_rank,
        )

    def delete_checkpoint(
        self, run_id: str, checkpoint_id: str | None = None
    ) -> t.DeleteCheckpointResponse:
        """Upstream's ``delete_checkpoint(run_id, checkpoint_id)``; or one ``twinkle://`` path
        as ``run_id`` alone."""
        path = getattr(run_id, "twinkle_path", run_id)
        if checkpoint_id is not None:
            path = self.get_checkpoint_twinkle_path(run_id, checkpoint_id)
        self.request("DELETE", self._mgmt("checkpoint"), params={"path": path})
        return t.DeleteCheckpointResponse(success=True, message=f"deleted {path}")

    def publish_checkpoint(self, twinkle_path: str) -> t.Checkpoint:
        """Make one of your checkpoints (a ``twinkle://`` path or a `SaveResponse`) readable by
        every user of the server: they can load it, sample from it and look it up by path.
        Returns it, now ``public``. Not upstream Twinkle's: this server's, through the endpoint
        the Tinker SDK's ``RestClient.publish_checkpoint_from_tinker_path`` calls."""
        path = str(getattr(twinkle_path, "twinkle_path", twinkle_path))
        rest = path.removeprefix("twinkle://").removeprefix("tinker://")
        run_id, _, checkpoint_id = rest.partition("/")
        if rest == path or not run_id or not checkpoint_id:
            raise InvalidRequestError(f"twinkle_path: {path!r} is not a twinkle:// checkpoint path")
        run = quote(run_id, safe=":")
        self.request("POST", f"training_runs/{run}/checkpoints/{checkpoint_id}/publish")
        return self.get_checkpoint(path)

    def get_latest_checkpoint_path(self, run_id: str) -> str | None:
        """The newest training checkpoint's ``twinkle://`` path (checkpoints live on the server:
        there is no local directory to return)."""
        ckpts = [c for c in self.list_checkpoints(run_id) if c.checkpoint_type == "training"]
        return ckpts[-1].twinkle_path if ckpts else None

    def download_tokenizer(self, base_model: str, dest: str | os.PathLike) -> str:
        """Fetch ``base_model``'s tokenizer files into ``dest``; returns it (load with
        `transformers.AutoTokenizer.from_pretrained(dest)` or `tokenizers.Tokenizer`)."""
        from pathlib import Path

        out = Path(dest)
        out.mkdir(parents=True, exist_ok=True)
        listing = self.get(self._mgmt("tokenizer"), {"base_model": base_model})
        for f in listing["files"]:
            resp = self.request(
                "GET", self._mgmt(f"tokenizer/{f['name']}"), params={"base_model": base_model}
            )
            (out / f["name"]).write_bytes(resp.content)
        return str(out)

    def close(self) -> None:
        """Stop heartbeats and close the connection (the server ends the session later)."""
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
    base_url: str | None = None,
    api_key: str | None = None,
    session_heartbeat_interval: float | None = DEFAULT_HEARTBEAT_S,
    **kwargs: Any,
) -> TwinkleClient:
    """Connect to ``base_url`` (default ``$TWINKLE_SERVER_URL``) with ``api_key`` (default
    ``$TWINKLE_SERVER_TOKEN``), open a session kept alive by heartbeats every
    ``session_heartbeat_interval`` seconds, and make it the client that
    `MultiLoraTransformersModel` / samplers / templates use by default. ``kwargs``:
    `TwinkleClient`'s (``session_metadata``, ``timeout``, ``transport``)."""
    global _current
    _current = TwinkleClient(
        base_url, api_key, session_heartbeat_interval=session_heartbeat_interval, **kwargs
    )
    return _current


def get_client(client: TwinkleClient | None = None) -> TwinkleClient:
    """``client``, else the current one, else one from the environment variables."""
    if client is not None:
        return client
    if _current is None or _current._closed.is_set():
        return init_twinkle_client()
    return _current
