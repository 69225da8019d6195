"""The console's only way to the service: a small client of the gateway's admin REST API
(``/api/v1/admin/...``), the admin key sent as ``X-API-Key``.

Every failure becomes an `ApiError` with a one-line message a person can act on (the gateway's
own ``detail``, which names the field and the rule, or what went wrong on the way to it), never
a traceback. The console never reads the database.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

import httpx

#: seconds before a call gives up (the engine stats behind /engine and /overview wait up to 5 s)
TIMEOUT_S = 15.0


class ApiError(Exception):
    """A failed admin API call: ``status`` is the HTTP status (None when no answer came)."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def _detail(r: httpx.Response) -> str:
    try:
        body = r.json()
    except ValueError:
        return r.text.strip()[:200] or r.reason_phrase
    detail = body.get("detail") if isinstance(body, dict) else None
    if isinstance(detail, list):  # FastAPI validation errors: name the fields
        return "; ".join(
            f"{'.'.join(str(p) for p in d.get('loc', [])[1:])}: {d.get('msg', '')}" for d in detail
        )
    return str(detail or body)[:300]


class AdminClient:
    def __init__(self, base_url: str, api_key: str, *, timeout: float = TIMEOUT_S) -> None:
        self.base_url = base_url.rstrip("/")
        self._http = httpx.Client(
            base_url=self.base_url + "/api/v1/admin",
            headers={"X-API-Key": api_key},
            timeout=timeout,
        )

    def close(self) -> None:
        self._http.close()

    def _call(self, method: str, path: str, **kw: Any) -> Any:
        try:
            r = self._http.request(method, path, **kw)
        except httpx.TimeoutException:
            raise ApiError(f"the gateway at {self.base_url} did not answer in time") from None
        except httpx.HTTPError as exc:
            raise ApiError(
                f"cannot reach the gateway at {self.base_url} ({type(exc).__name__})"
            ) from None
        if r.status_code >= 400:
            raise ApiError(f"{r.status_code} {r.reason_phrase}: {_detail(r)}", r.status_code)
        try:
            return r.json()
        except ValueError:
            raise ApiError(f"the gateway answered {path} with something not JSON") from None

    # -- who, overview, engine ------------------------------------------------------------------
    def whoami(self) -> dict:
        return self._call("GET", "/whoami")

    def overview(self) -> dict:
        return self._call("GET", "/overview")

    def engine(self) -> dict:
        return self._call("GET", "/engine")["models"]

    # -- organizations and users ----------------------------------------------------------------
    def orgs(self) -> list[dict]:
        return self._call("GET", "/orgs")["orgs"]

    def create_org(self, name: str) -> dict:
        return self._call("POST", "/orgs", json={"name": name})

    def set_org_disabled(self, org_id: int, disabled: bool) -> dict:
        return self._call("PATCH", f"/orgs/{org_id}", json={"disabled": disabled})

    def users(self, org_id: int | None = None) -> list[dict]:
        params = {} if org_id is None else {"org_id": org_id}
        return self._call("GET", "/users", params=params)["users"]

    def create_user(self, name: str, org: str | None, admin: bool = False) -> dict:
        return self._call("POST", "/users", json={"name": name, "org": org, "admin": admin})

    def set_user_disabled(self, user_id: int, disabled: bool) -> dict:
        return self._call("PATCH", f"/users/{user_id}", json={"disabled": disabled})

    # -- keys -----------------------------------------------------------------------------------
    def keys(self, prefix: str | None = None, user_id: int | None = None) -> list[dict]:
        params: dict[str, Any] = {}
        if prefix:
            params["prefix"] = prefix
        if user_id is not None:
            params["user_id"] = user_id
        return self._call("GET", "/keys", params=params)["keys"]

    def create_key(
        self,
        user_id: int,
        scope: str = "user",
        name: str | None = None,
        expires_in_s: int | None = None,
    ) -> dict:
        body = {"user_id": user_id, "scope": scope, "name": name or None}
        if expires_in_s:
            body["expires_in_seconds"] = expires_in_s
        return self._call("POST", "/keys", json=body)

    def revoke_key(self, key_id: int) -> dict:
        return self._call("POST", f"/keys/{key_id}/revoke")

    # -- quotas and usage -----------------------------------------------------------------------
    def quota_names(self) -> dict[str, str]:
        return self._call("GET", "/quotas")["quotas"]

    def limits(self, subject_type: str, subject_id: int) -> dict[str, int]:
        return self._call("GET", f"/quotas/{subject_type}/{subject_id}")["limits"]

    def set_limits(self, subject_type: str, subject_id: int, limits: dict[str, int | None]) -> dict:
        return self._call("PUT", f"/quotas/{subject_type}/{subject_id}", json={"limits": limits})[
            "limits"
        ]

    def quota_usage(self, subject_type: str, subject_id: int) -> dict[str, dict]:
        path = "users" if subject_type == "user" else "orgs"
        return self._call("GET", f"/{path}/{subject_id}/quota_usage")["levels"]

    def usage(
        self, start: datetime, end: datetime, org_id: int | None = None, user_id: int | None = None
    ) -> list[dict]:
        params: dict[str, Any] = {"start": start.isoformat(), "end": end.isoformat()}
        if org_id is not None:
            params["org_id"] = org_id
        if user_id is not None:
            params["user_id"] = user_id
        return self._call("GET", "/usage", params=params)["buckets"]

    # -- audit ----------------------------------------------------------------------------------
    def audit(
        self,
        *,
        events: list[str] | None = None,
        org_id: int | None = None,
        start: datetime | None = None,
        end: datetime | None = None,
        limit: int = 50,
        offset: int = 0,
    ) -> dict:
        """One page, newest first: ``{"entries": [...], "total": n}``."""
        params: dict[str, Any] = {"limit": limit, "offset": offset, "newest_first": True}
        if events:
            params["event"] = events
        if org_id is not None:
            params["org_id"] = org_id
        if start is not None:
            params["start"] = start.isoformat()
        if end is not None:
            params["end"] = end.isoformat()
        return self._call("GET", "/audit", params=params)
