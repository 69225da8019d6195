"""Session traces: the per-session log of finished requests, and its Chrome / Perfetto trace.

Owns `trace_tag` (what a submitted future carries so its end is logged), `RequestLog` (one
`RequestTraceRow` per finished future that carries a tag, buffered and written every
`FLUSH_S` seconds in one transaction: a per-request commit would put a DB write on every training
step of every tenant), `chrome_trace` (the rows of one session as
a Chrome trace-event JSON document, which https://ui.perfetto.dev and chrome://tracing open) and
`build_trace_file` (writes it under ``<data_dir>/exports/traces/``).

What a trace holds: per request its kind, the model or sampler it ran on, submit and finish time,
status, error category and message. Never a payload, a result, a key or a user name (the session
is named by its id only). For a training run, whose requests run one at a time in seq_id order,
``queued_behind_previous_ms`` is how long a request waited for the run's previous request to
finish (its submit time to the previous one's finish, if later); sampler requests run
concurrently, so they get no such figure.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from sqlalchemy.engine import Engine
from sqlmodel import Session, col, select

from gateway.db.tables import RequestTraceRow, SessionRow
from gateway.futures.record import FutureRecord

log = logging.getLogger(__name__)
#: error messages are cut to this many characters in a trace (a message names fields and rules;
#: 300 is several lines of it)
ERROR_CHARS = 300
#: how often buffered trace rows are written; a trace build waits this long first, so it sees
#: every request that finished before the export was asked for, on every gateway replica
FLUSH_S = 1.0


def trace_tag(session_id: str, target: str) -> dict[str, str]:
    """The ``extra["trace"]`` of a future of session ``session_id`` on ``target`` (a training
    run's model_id or a sampler id)."""
    return {"session_id": session_id, "target": target}


class RequestLog:
    """Buffers the trace row of each finished, tagged future (`FutureStore.on_finish`) and writes
    them every `FLUSH_S` seconds (`run_flusher`) and at shutdown (`flush`)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._rows: list[RequestTraceRow] = []

    async def record(self, rec: FutureRecord) -> None:
        tag = rec.extra.get("trace") or {}
        if not tag.get("session_id"):
            return
        finished = rec.submitted_at + max(0.0, (rec.finished_at or rec.created) - rec.created)
        row = RequestTraceRow(
            session_id=str(tag["session_id"])[:64],
            user_id=rec.user_id,
            request_id=rec.request_id,
            kind=rec.kind[:32],
            target=str(tag.get("target") or "")[:128],
            submitted=rec.submitted_at,
            finished=finished,
            status="failed" if rec.error is not None else "ok",
            error_category=rec.category if rec.error is not None else None,
            error=None if rec.error is None else rec.error[:ERROR_CHARS],
        )
        self._rows.append(row)

    async def flush(self) -> None:
        rows, self._rows = self._rows, []
        if rows:
            await asyncio.to_thread(self._write, rows)

    async def run_flusher(self) -> None:
        while True:
            await asyncio.sleep(FLUSH_S)
            try:
                await self.flush()
            except Exception:  # best effort: a trace must never take the gateway down
                log.exception("could not write session trace rows")

    def _write(self, rows: list[RequestTraceRow]) -> None:
        with Session(self.engine) as db:
            db.add_all(rows)
            db.commit()


def _is_training(target: str) -> bool:
    return ":sample:" not in target and not target.startswith("sampler")


def chrome_trace(session: SessionRow, rows: Sequence[RequestTraceRow]) -> dict[str, Any]:
    """The session's requests as Chrome trace events: one track (tid) per model or sampler,
    one complete event ("X", microseconds) per request, in submit order."""
    rows = sorted(rows, key=lambda r: (r.submitted, r.id or 0))
    origin = rows[0].submitted if rows else 0.0
    tids: dict[str, int] = {}
    events: list[dict[str, Any]] = []
    last_finish: dict[str, float] = {}
    for r in rows:
        tid = tids.setdefault(r.target, len(tids) + 1)
        args: dict[str, Any] = {"request_id": r.request_id, "status": r.status}
        if _is_training(r.target):
            behind = max(0.0, last_finish.get(r.target, r.submitted) - r.submitted)
            args["queued_behind_previous_ms"] = round(behind * 1000.0, 3)
            last_finish[r.target] = max(last_finish.get(r.target, 0.0), r.finished)
        if r.status != "ok":
            args["error_category"], args["error"] = r.error_category, r.error
        events.append(
            {
                "name": r.kind,
                "cat": "training" if _is_training(r.target) else "sampling",
                "ph": "X",
                "pid": 1,
                "tid": tid,
                "ts": round((r.submitted - origin) * 1e6, 1),
                "dur": round(max(0.0, r.finished - r.submitted) * 1e6, 1),
                "args": args,
            }
        )
    meta = [{"name": "process_name", "ph": "M", "pid": 1, "args": {"name": session.id}}]
    meta += [
        {"name": "thread_name", "ph": "M", "pid": 1, "tid": tid, "args": {"name": target}}
        for target, tid in tids.items()
    ]
    return {
        "traceEvents": meta + events,
        "displayTimeUnit": "ms",
        "otherData": {
            "session_id": session.id,
            "created_at": session.created_at.isoformat(),
            "requests": len(rows),
            "failed": sum(r.status != "ok" for r in rows),
            "started_unix_s": origin,
        },
    }


def trace_path(data_dir: Path, session_id: str) -> Path:
    """Where a session's trace file lives (named by a digest: ids never become paths)."""
    name = hashlib.sha256(session_id.encode()).hexdigest()[:32]
    return Path(data_dir) / "exports" / "traces" / f"{name}.json"


def build_trace_file(engine: Engine, data_dir: Path, session_id: str) -> Path:
    """Write the session's current trace (atomically: readers never see half a file), after
    waiting out one flush of every replica's buffered rows."""
    time.sleep(FLUSH_S * 1.5)
    with Session(engine) as db:
        session = db.get(SessionRow, session_id)
        if session is None:
            raise LookupError(f"session {session_id!r} is gone")
        rows = db.exec(
            select(RequestTraceRow)
            .where(RequestTraceRow.session_id == session_id)
            .order_by(col(RequestTraceRow.submitted))
        ).all()
        doc = chrome_trace(session, rows)
    path = trace_path(data_dir, session_id)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc, separators=(",", ":")))
    tmp.replace(path)
    return path
