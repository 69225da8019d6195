"""`init_twinkle_client()` and the management calls of the native client.

Owns: base URL / key resolution (arguments, then `TWINKLE_SERVER_URL` / `TWINKLE_SERVER_TOKEN`),
the HTTP transport (injectable for tests) and error mapping. Training classes build on this.
"""

from __future__ import annotations

import os
from typing import Any

import httpx


class TwinkleError(Exception):
    """A request failed; ``status_code`` is the HTTP status (0 when the server was unreachable)."""

    def __init__(self, message: str, status_code: int = 0) -> None:
        super().__init__(message)
        self.status_code = status_code


class TwinkleClient:
    def __init__(
        self,
        base_url: str,
        api_key: str,
        *,
        timeout: float = 60.0,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self._http = httpx.Client(
            base_url=self.base_url,
            headers={"X-API-Key": api_key},
            timeout=timeout,
            transport=transport,
        )

    def _request(self, method: str, path: str, **kw: Any) -> Any:
        try:
            resp = self._http.request(method, f"/api/v1/{path}", **kw)
        except httpx.HTTPError as exc:
            raise TwinkleError(f"cannot reach {self.base_url}: {exc}") from exc
        if resp.status_code >= 400:
            try:
                body = resp.json()
                msg = body.get("detail") or body.get("error") or resp.text
            except ValueError:
                msg = resp.text
            raise TwinkleError(f"HTTP {resp.status_code}: {msg}", resp.status_code)
        return resp.json()

    def health(self) -> bool:
        return self._request("GET", "healthz").get("status") == "ok"

    def get_server_capabilities(self) -> dict[str, Any]:
        return self._request("GET", "get_server_capabilities")

    def list_training_runs(self, limit: int = 20, offset: int = 0) -> dict[str, Any]:
        return self._request("GET", "training_runs", params={"limit": limit, "offset": offset})

    def list_checkpoints(self, run_id: str) -> list[dict[str, Any]]:
        return self._request("GET", f"training_runs/{run_id}/checkpoints")["checkpoints"]

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> TwinkleClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def init_twinkle_client(
    base_url: str | None = None, api_key: str | None = None, **kw: Any
) -> TwinkleClient:
    """A client for ``base_url`` (default ``$TWINKLE_SERVER_URL``) with ``api_key`` (default
    ``$TWINKLE_SERVER_TOKEN``)."""
    url = base_url or os.environ.get("TWINKLE_SERVER_URL")
    key = api_key or os.environ.get("TWINKLE_SERVER_TOKEN")
    if not url:
        raise TwinkleError("base_url: not given and TWINKLE_SERVER_URL is not set")
    if not key:
        raise TwinkleError("api_key: not given and TWINKLE_SERVER_TOKEN is not set")
    return TwinkleClient(url, key, **kw)
