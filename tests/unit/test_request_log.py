"""The session trace document (gateway/runs/request_log.py): tracks per model / sampler, the wait
behind a training run's previous request, failures, and nothing but what the rows hold."""

from __future__ import annotations

from datetime import datetime

from gateway.db.tables import RequestTraceRow, SessionRow
from gateway.runs.request_log import chrome_trace


def _row(i: int, target: str, kind: str, t0: float, t1: float, error: str | None = None):
    return RequestTraceRow(
        id=i,
        session_id="s1",
        user_id=7,
        request_id=f"req-{i}",
        kind=kind,
        target=target,
        submitted=t0,
        finished=t1,
        status="failed" if error else "ok",
        error_category="user" if error else None,
        error=error,
    )


def test_tracks_waits_and_failures() -> None:
    session = SessionRow(id="s1", user_id=7, created_at=datetime(2026, 12, 5))
    run, sampler = "s1:train:0", "s1:sample:0"
    rows = [
        _row(1, run, "forward_backward", 100.0, 100.5),
        _row(2, run, "optim_step", 100.1, 100.7),  # queued: submitted before 1 finished
        _row(3, sampler, "sample", 100.2, 100.4),
        _row(4, run, "forward_backward", 101.0, 101.1, "data[0].model_input: bad"),
    ]
    doc = chrome_trace(session, list(reversed(rows)))  # order of rows does not matter
    events = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    assert [e["name"] for e in events] == [
        "forward_backward",
        "optim_step",
        "sample",
        "forward_backward",
    ]
    assert [e["ts"] for e in events] == [0.0, 100000.0, 200000.0, 1000000.0]
    assert events[1]["dur"] == 600000.0
    waits = [e["args"].get("queued_behind_previous_ms") for e in events]
    assert waits == [0.0, 400.0, None, 0.0]  # samplers run concurrently: no figure
    assert (
        events[2]["cat"] == "sampling" and events[0]["tid"] == events[1]["tid"] != events[2]["tid"]
    )
    assert events[3]["args"] == {
        "request_id": "req-4",
        "status": "failed",
        "queued_behind_previous_ms": 0.0,
        "error_category": "user",
        "error": "data[0].model_input: bad",
    }
    names = {e["args"]["name"] for e in doc["traceEvents"] if e["name"] == "thread_name"}
    assert names == {run, sampler}
    assert doc["otherData"]["requests"] == 4 and doc["otherData"]["failed"] == 1
