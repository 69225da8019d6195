"""Usage page: per organization, user and UTC day, training vs sampling tokens, checkpoint saves
and storage (GB-hours), with a chart and a CSV download of the table.

Source: ``GET /api/v1/admin/usage?start=&end=&org_id=&user_id=`` (the hourly ledger), summed here
per day; ``GET /api/v1/admin/orgs`` and ``/users`` for names.
"""

from __future__ import annotations

import csv
import io
from datetime import UTC, datetime, time, timedelta

import pandas as pd
import streamlit as st

from admin_ui import charts, fmt
from admin_ui.client import AdminClient

ALL = "(all)"
COLUMNS = {
    "training": "Training tokens",
    "sampling_prefill": "Sampling prompt tokens",
    "sampling_sample": "Sampled tokens",
    "checkpoint": "Checkpoint saves",
}
#: the table's columns after day, organization and user
ORDER = [
    "Training tokens",
    "Sampling tokens",
    "Sampling prompt tokens",
    "Sampled tokens",
    "Checkpoint saves",
    "Storage GB-h",
]


def daily(buckets: list[dict], orgs: dict[int, str], users: dict[int, str]) -> list[dict]:
    """Hourly buckets -> one row per (day, organization, user) with a column per kind, newest
    day first, then by organization and user name."""
    rows: dict[tuple[str, str, str], dict] = {}
    for b in buckets:
        org = orgs.get(b["org_id"], "") if b["org_id"] is not None else ""
        key = (b["bucket_start"][:10], org, users.get(b["user_id"], f"user {b['user_id']}"))
        row = rows.setdefault(
            key,
            {"Day": key[0], "Organization": key[1], "User": key[2]}
            | dict.fromkeys(ORDER[:-1], 0)
            | {"Storage GB-h": 0.0},
        )
        if b["kind"] in COLUMNS:
            row[COLUMNS[b["kind"]]] += b["quantity"]
        if b["kind"] in ("sampling_prefill", "sampling_sample"):
            row["Sampling tokens"] += b["quantity"]
        if b["kind"] == "storage":
            row["Storage GB-h"] = round(row["Storage GB-h"] + b["gigabyte_hours"], 4)
    ordered = sorted(rows.items(), key=lambda kv: (kv[0][1], kv[0][2]))
    return [r for _, r in sorted(ordered, key=lambda kv: kv[0][0], reverse=True)]


def to_csv(rows: list[dict]) -> bytes:
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=list(rows[0]))
    writer.writeheader()
    writer.writerows(rows)
    return out.getvalue().encode()


def render(api: AdminClient) -> None:
    st.title("Usage")
    orgs, users = api.orgs(), api.users()
    org_names, user_names = fmt.names(orgs), fmt.names(users)
    today = datetime.now(UTC).date()
    c1, c2, c3 = st.columns([2, 1, 1])
    span = c1.date_input(
        "Days (UTC)", value=(today - timedelta(days=6), today), max_value=today, key="usage_days"
    )
    org = c2.selectbox("Organization", [ALL, *(o["name"] for o in orgs)], key="usage_org")
    user = c3.selectbox("User", [ALL, *(u["name"] for u in users)], key="usage_user")
    if not isinstance(span, tuple) or len(span) != 2:
        st.info("Pick the first and the last day.")
        return
    first, last = span
    start = datetime.combine(first, time.min)
    end = datetime.combine(last + timedelta(days=1), time.min)
    org_id = next((i for i, n in org_names.items() if n == org), None)
    user_id = next((i for i, n in user_names.items() if n == user), None)
    rows = daily(api.usage(start, end, org_id=org_id, user_id=user_id), org_names, user_names)
    if not rows:
        st.info("No usage recorded in these days.")
        return
    m = st.columns(4)
    for col, name in zip(
        m[:3], ("Training tokens", "Sampling tokens", "Checkpoint saves"), strict=True
    ):
        col.metric(name, fmt.count(sum(r[name] for r in rows)))
    m[3].metric("Storage", f"{sum(r['Storage GB-h'] for r in rows):,.3f} GB-h")
    per_day = {
        str(first + timedelta(days=i)): {"Day": str(first + timedelta(days=i)), "t": 0, "s": 0}
        for i in range((last - first).days + 1)
    }
    for r in rows:
        per_day[r["Day"]]["t"] += r["Training tokens"]
        per_day[r["Day"]]["s"] += r["Sampling tokens"]
    st.markdown("**Tokens per day**")
    charts.day_bars(list(per_day.values()), {"t": "training", "s": "sampling"}, "tokens")
    number = st.column_config.NumberColumn(format="localized")
    st.dataframe(
        pd.DataFrame(rows),
        hide_index=True,
        width="stretch",
        column_config=dict.fromkeys(list(rows[0])[3:], number),
    )
    st.download_button(
        "Download CSV",
        to_csv(rows),
        file_name=f"twinkle-usage-{first}-{last}.csv",
        mime="text/csv",
    )
