"""Audit log page: filter by event type, organization and days; newest first, `PAGE_SIZE` entries
a page with previous / next.

Source: ``GET /api/v1/admin/audit?event=&org_id=&start=&end=&limit=&offset=&newest_first=true``
(``total`` in the answer sizes the pager); ``GET /api/v1/admin/orgs`` and ``/users`` for names.
"""

from __future__ import annotations

from datetime import UTC, datetime, time, timedelta

import pandas as pd
import streamlit as st

from admin_ui import fmt
from admin_ui.client import AdminClient

PAGE_SIZE = 50
ALL = "(all)"
#: the events the gateway writes (gateway/accounts/audit.py)
EVENTS = [
    "key_created",
    "key_revoked",
    "organization_created",
    "organization_updated",
    "user_created",
    "user_updated",
    "quota_changed",
    "access_denied",
]


def _reset_page() -> None:
    st.session_state["audit_page"] = 0


def _filters(
    org_names: dict[int, str],
) -> tuple[list[str], int | None, datetime | None, datetime | None]:
    """The filter row: (events, organization id, start, end); None: not filtered by it."""
    today = datetime.now(UTC).date()
    c1, c2, c3 = st.columns([2, 1, 1])
    events = c1.multiselect(
        "Events", EVENTS, key="audit_events", placeholder="all events", on_change=_reset_page
    )
    org = c2.selectbox(
        "Organization", [ALL, *org_names.values()], key="audit_org", on_change=_reset_page
    )
    span = c3.date_input(
        "Days (UTC)",
        value=(today - timedelta(days=29), today),
        max_value=today,
        key="audit_days",
        on_change=_reset_page,
    )
    start = end = None
    if isinstance(span, tuple) and len(span) == 2:
        start = datetime.combine(span[0], time.min)
        end = datetime.combine(span[1] + timedelta(days=1), time.min)
    org_id = next((i for i, n in org_names.items() if n == org), None)
    return events, org_id, start, end


def _row(e: dict, org_names: dict[int, str], user_names: dict[int, str]) -> dict:
    """One audit entry as a table row: who did it (user and key prefix), to which organization."""
    d = dict(e.get("event_details") or {})
    actor = d.pop("actor_user_id", None)
    prefix = d.pop("actor_key_prefix", None)
    org_of = d.pop("org_id", None)
    who = user_names.get(actor, f"user {actor}") if actor is not None else ""
    return {
        "Time": fmt.when(e.get("timestamp")),
        "Event": e.get("event", ""),
        "Organization": org_names.get(org_of, "") if org_of is not None else "",
        "Actor": f"{who} · {prefix}…" if prefix else who,
        "Details": fmt.event_summary(e.get("event", ""), d),
    }


def _pager(page: int, pages: int, total: int) -> None:
    prev, label, nxt = st.columns([1, 3, 1])
    if prev.button("← Newer", disabled=page == 0, key="audit_prev"):
        st.session_state["audit_page"] = page - 1
        st.rerun()
    label.markdown(
        f"<div style='text-align:center'>Page {page + 1} of {pages} · {fmt.count(total)} "
        "entries</div>",
        unsafe_allow_html=True,
    )
    if nxt.button("Older →", disabled=page + 1 >= pages, key="audit_next"):
        st.session_state["audit_page"] = page + 1
        st.rerun()


def render(api: AdminClient) -> None:
    st.title("Audit log")
    orgs, users = api.orgs(), api.users()
    org_names, user_names = fmt.names(orgs), fmt.names(users)
    events, org_id, start, end = _filters(org_names)
    page = st.session_state.setdefault("audit_page", 0)
    answer = api.audit(
        events=events or None,
        org_id=org_id,
        start=start,
        end=end,
        limit=PAGE_SIZE,
        offset=page * PAGE_SIZE,
    )
    total, entries = answer["total"], answer["entries"]
    rows = [_row(e, org_names, user_names) for e in entries]
    if rows:
        st.dataframe(
            pd.DataFrame(rows),
            hide_index=True,
            width="stretch",
            # every row of the page visible (35 px a row + the header), no inner scrolling
            height=35 * (len(rows) + 1) + 3,
            column_config={
                "Time": st.column_config.TextColumn(width=165),
                "Event": st.column_config.TextColumn(width=150),
                "Organization": st.column_config.TextColumn(width=110),
                "Actor": st.column_config.TextColumn(width=190),
            },
        )
    else:
        st.info("No audit entries match these filters.")
    _pager(page, max(1, -(-total // PAGE_SIZE)), total)
