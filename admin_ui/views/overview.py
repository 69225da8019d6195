"""Overview page: models and replicas, queue depth and wait, active tenants, tokens/s and error
rate, with charts over time.

Source: ``GET /api/v1/admin/overview`` (gauges and cumulative counters). The history behind the
charts is kept here, in the browser session (``st.session_state["history"]``, at most
`HISTORY_MAX` polls): a rate is the difference of two polls over their time apart, so it needs a
second poll, and it starts again when the console is reloaded or the gateway restarts (a counter
that went down is treated as a restart, not a negative rate). Requests and errors are those of
the gateway replica that answered.
"""

from __future__ import annotations

from datetime import datetime

import pandas as pd
import streamlit as st

from admin_ui import charts, fmt
from admin_ui.client import AdminClient, ApiError

#: polls kept for the charts: 30 minutes at one poll every `REFRESH_S` seconds
HISTORY_MAX = 360
REFRESH_S = 5


def sample(ov: dict) -> dict:
    """The numbers of one overview answer the history keeps."""
    req = ov["requests"]
    return {
        "at": datetime.fromisoformat(ov["at"].rstrip("Z")),
        "training_jobs": ov["queue"]["training_jobs"],
        "sampling_requests": ov["queue"]["sampling_requests"],
        "oldest_wait_s": ov["queue"]["oldest_wait_s"],
        "active_tenants": ov["active_tenants"]["last_hour"],
        "training_tokens": ov["tokens_total"]["training"],
        "sampling_tokens": ov["tokens_total"]["sampling"],
        "requests": req["total"] or 0,
        "server_errors": req["server_errors"] or 0,
    }


def rates(prev: dict, cur: dict) -> dict:
    """Per-second rates between two samples (None when a counter went back: a restart)."""
    dt = (cur["at"] - prev["at"]).total_seconds()

    def per_s(name: str) -> float | None:
        d = cur[name] - prev[name]
        return d / dt if dt > 0 and d >= 0 else None

    requests = cur["requests"] - prev["requests"]
    errors = cur["server_errors"] - prev["server_errors"]
    return {
        "at": cur["at"],
        "training_tokens_per_s": per_s("training_tokens"),
        "sampling_tokens_per_s": per_s("sampling_tokens"),
        # requests this poll made itself count too, so an idle service shows 0%, not "—"
        "error_rate": errors / requests if requests > 0 and errors >= 0 else None,
    }


def record(ov: dict) -> list[dict]:
    history: list[dict] = st.session_state.setdefault("history", [])
    history.append(sample(ov))
    del history[:-HISTORY_MAX]
    return history


def _models_table(ov: dict) -> None:
    rows = [
        {
            "Model": m["name"],
            "Replicas (train / sample)": f"{m['trainer_replicas']} / {m['sampler_replicas']}",
            "Queued (train / sample)": (
                f"{m['training_jobs_queued']:,} / {m['sampling_requests_queued']:,}"
            ),
            "Oldest wait": fmt.seconds(m["oldest_wait_s"]),
            "Adapters (loaded / offloaded)": (
                f"{m['adapters_loaded']:,} / {m['adapters_offloaded']:,}"
            ),
            "Execution": m["execution"] or "",
            "Status": f"no answer ({m['error']})" if m["error"] else "ok",
        }
        for m in ov["models"]
    ]
    st.dataframe(pd.DataFrame(rows), hide_index=True, width="stretch")


def _charts(history: list[dict]) -> None:
    left, mid, right = st.columns(3)
    with left:
        st.markdown("**Queue depth**")
        charts.lines(
            history,
            {"training_jobs": "training jobs", "sampling_requests": "sampling requests"},
            "waiting",
            whole=True,
        )
    rate_rows = [rates(a, b) for a, b in zip(history, history[1:], strict=False)]
    for col, title in ((mid, "Tokens/s"), (right, "Error rate (5xx)")):
        with col:
            st.markdown(f"**{title}**")
            if not rate_rows:
                st.caption("Rates appear after the second poll.")
    if not rate_rows:
        return
    with mid:
        charts.lines(
            rate_rows,
            {"training_tokens_per_s": "training", "sampling_tokens_per_s": "sampling"},
            "tokens/s",
        )
    with right:
        charts.lines(
            rate_rows, {"error_rate": "5xx share"}, "of requests", y_format=".0%", floor=0.05
        )


def _body(api: AdminClient) -> None:
    try:
        ov = api.overview()
    except ApiError as exc:  # this part reruns on its own: the app's handler is not around it
        st.error(exc.message)
        return
    try:
        _show(ov)
    except Exception as exc:  # as in app.py: one line, never a traceback
        st.error(f"The console failed on this page: {type(exc).__name__}: {exc}")


def _show(ov: dict) -> None:
    history = record(ov)
    last = rates(history[-2], history[-1]) if len(history) > 1 else {}
    m = ov["models"]
    replicas = sum(x["trainer_replicas"] + x["sampler_replicas"] for x in m)
    cols = st.columns(7)
    cols[0].metric("Models", fmt.count(len(m)))
    cols[1].metric("Engine replicas", fmt.count(replicas), help="Trainer + Sampler replicas")
    cols[2].metric(
        "Queue depth",
        fmt.count(ov["queue"]["training_jobs"] + ov["queue"]["sampling_requests"]),
        help="Training jobs and sampling requests waiting",
    )
    cols[3].metric("Oldest wait", fmt.seconds(ov["queue"]["oldest_wait_s"]))
    cols[4].metric(
        "Active tenants",
        fmt.count(ov["active_tenants"]["last_hour"]),
        help=f"Users with usage this or last hour; {ov['active_tenants']['queued_now']} queued now",
    )
    train, samp = last.get("training_tokens_per_s"), last.get("sampling_tokens_per_s")
    total_tps = train + samp if train is not None and samp is not None else None
    cols[5].metric("Tokens/s", fmt.rate(total_tps, ""), help="Training + sampling, last poll")
    cols[6].metric("Error rate", fmt.percent(last.get("error_rate")), help="5xx share, last poll")
    st.subheader("Models")
    _models_table(ov)
    st.subheader("Over time")
    _charts(history)
    st.caption(
        f"Last poll {fmt.when(ov['at'])} · {len(history)} polls kept (at most {HISTORY_MAX}) · "
        f"requests answered by this gateway replica: {fmt.count(ov['requests']['total'])}"
    )


def render(api: AdminClient) -> None:
    st.title("Overview")
    left, right = st.columns([1, 5], vertical_alignment="center")
    if left.button("Refresh now"):
        pass  # the click itself reruns the page, which polls
    auto = right.toggle(f"Refresh every {REFRESH_S} s", value=True, key="overview_auto")
    st.fragment(run_every=REFRESH_S if auto else None)(_body)(api)
