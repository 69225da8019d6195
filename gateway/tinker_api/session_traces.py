"""Session trace export (RestClient.export_session_trace): build, poll, signed download.

``GET /sessions/{id}/trace_export`` starts building the session's trace (gateway/runs/
request_log.py: a Chrome trace-event JSON of its requests, which Perfetto opens) and answers
``pending``; the SDK polls every 5 s, and the poll after the build finished answers ``ready`` with
a signed URL (``failed`` with the reason if the build failed). The poll after that starts a fresh
build, so a trace is never stale by more than one export. Only the session's owner can export it
(another user's session is a 404, as everywhere).

The URL is served by this gateway and signed with HMAC-SHA256 over (session, expiry) with the
same key as weight downloads but its own domain prefix (a weights signature never opens a trace);
whoever holds it can download without an API key until it expires (403 tampered, 410 expired).
Builds run per gateway replica; the file lives in the data dir, which every replica shares.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import time

from fastapi import APIRouter, Query, Request
from fastapi.responses import FileResponse

from gateway.context import ServicesDep
from gateway.db.tables import SessionRow
from gateway.deps import ConfigDep, DbDep, PrincipalDep, SecretsDep, SettingsDep
from gateway.errors import GoneError, NotFoundError, PermissionDeniedError
from gateway.runs.request_log import build_trace_file, trace_path
from gateway.tinker_api.schemas import TraceExportResponse, returns

router = APIRouter(prefix="/api/v1")
_DOMAIN = b"session-trace\n"


def _signature(key: bytes, session_id: str, expires: int) -> str:
    msg = _DOMAIN + f"{session_id}\n{expires}".encode()
    return hmac.new(key, msg, hashlib.sha256).hexdigest()


@router.get("/sessions/{session_id}/trace_export", **returns(TraceExportResponse))
async def export_session_trace(
    session_id: str,
    request: Request,
    services: ServicesDep,
    who: PrincipalDep,
    db: DbDep,
    secrets: SecretsDep,
    config: ConfigDep,
    settings: SettingsDep,
) -> dict:
    """Start (or report) the build of this session's trace file; ready → a signed URL."""
    row = db.get(SessionRow, session_id)
    if row is None or row.user_id != who.user_id:
        raise NotFoundError(f"session_id: session {session_id!r} not found")
    builds = services.trace_builds
    task = builds.get(session_id)
    if task is None:
        engine, data_dir = services.db_engine, settings.data_dir
        builds[session_id] = asyncio.create_task(
            asyncio.to_thread(build_trace_file, engine, data_dir, session_id)
        )
        return {"status": "pending"}
    if not task.done():
        return {"status": "pending"}
    del builds[session_id]
    if task.exception() is not None:
        return {"status": "failed", "error": f"building the trace failed: {task.exception()}"}
    expires = int(time.time() + config.download_url_ttl_seconds)
    sig = _signature(secrets.url_signing, session_id, expires)
    base = str(request.base_url).rstrip("/")
    url = f"{base}/api/v1/session_traces/{session_id}?expires={expires}&sig={sig}"
    return {"status": "ready", "url": url}


@router.get("/session_traces/{session_id}", response_model=None)
async def download_session_trace(
    session_id: str,
    secrets: SecretsDep,
    settings: SettingsDep,
    expires: int = Query(...),
    sig: str = Query(..., max_length=128),
) -> FileResponse:
    """No API key: the signature is the credential."""
    good = _signature(secrets.url_signing, session_id, expires)
    # bytes: compare_digest refuses a str with non-ASCII characters (a 500 otherwise)
    if not hmac.compare_digest(good.encode(), sig.encode("utf-8", "surrogatepass")):
        raise PermissionDeniedError("download: the URL's signature does not match")
    if expires < time.time():
        raise GoneError("download: this URL has expired; call export_session_trace again")
    path = trace_path(settings.data_dir, session_id)
    if not path.is_file():
        raise NotFoundError("download: the trace file is gone; call export_session_trace again")
    return FileResponse(path, filename=f"{session_id}.trace.json", media_type="application/json")
