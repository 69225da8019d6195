"""Quotas page: one organization's or user's current use against its limits, and a form to change
the limits (an empty field removes the limit: unlimited at that level, or for a user the server's
default user quota).

Sources: ``GET /api/v1/admin/quotas`` (names and meanings), ``GET/PUT
/api/v1/admin/quotas/{org|user}/{id}``, ``GET /api/v1/admin/{users|orgs}/{id}/quota_usage``.
"""

from __future__ import annotations

import pandas as pd
import streamlit as st

from admin_ui import fmt
from admin_ui.client import AdminClient, ApiError

LEVELS = {"Organization": "org", "User": "user"}


def _usage_rows(names: dict[str, str], level: dict[str, dict]) -> list[dict]:
    rows = []
    for name, meaning in names.items():
        use = level.get(name, {})
        cur, limit = use.get("current"), use.get("limit")
        show = fmt.nbytes if name.endswith("_bytes") else fmt.count
        rows.append(
            {
                "Quota": name,
                "Meaning": meaning,
                "Current": show(cur) if cur is not None else "—",
                "Limit": show(limit) if limit is not None else "unlimited",
                "Used": min(cur / limit, 1.0) if cur is not None and limit else None,
            }
        )
    return rows


def _usage_table(rows: list[dict]) -> None:
    st.caption("Current “—”: the gateway tracks a rate only while some limit applies to it.")
    st.dataframe(
        pd.DataFrame(rows),
        hide_index=True,
        width="stretch",
        column_config={
            "Used": st.column_config.ProgressColumn(
                "Used", min_value=0.0, max_value=1.0, format="percent"
            )
        },
    )


def _edit(api: AdminClient, kind: str, sid: int, names: dict[str, str], limits: dict) -> None:
    with st.form(f"edit_{kind}_{sid}"):
        st.markdown("**Change limits** (empty = no limit at this level)")
        cols = st.columns(3)
        new: dict[str, int | None] = {}
        for i, name in enumerate(names):
            value = cols[i % 3].number_input(
                name, min_value=0, step=1, value=limits.get(name), key=f"q_{kind}_{sid}_{name}"
            )
            new[name] = None if value is None else int(value)
        if st.form_submit_button("Save limits", type="primary"):
            changed = {k: v for k, v in new.items() if v != limits.get(k)}
            if not changed:
                st.info("No limit changed.")
                return
            try:
                api.set_limits(kind, sid, changed)
            except ApiError as exc:
                st.error(exc.message)
            else:
                st.session_state["quotas_flash"] = "Saved: " + ", ".join(
                    f"{k} = {'unlimited' if v is None else fmt.count(v)}"
                    for k, v in changed.items()
                )
                st.rerun()


def render(api: AdminClient) -> None:
    st.title("Quotas")
    flash = st.session_state.pop("quotas_flash", None)
    if flash:
        st.success(flash)
    names = api.quota_names()
    level = st.radio("Level", list(LEVELS), horizontal=True, key="quota_level")
    kind = LEVELS[level or "Organization"]
    subjects = api.orgs() if kind == "org" else api.users()
    if not subjects:
        st.info(f"No {level.lower() if level else 'subject'} yet.")
        return
    by_label = {f"{s['name']} (id {s['id']})": s for s in subjects}
    choice = st.selectbox(level or "Subject", list(by_label), key=f"quota_subject_{kind}")
    subject = by_label[choice or next(iter(by_label))]
    usage = api.quota_usage(kind, subject["id"])
    limits = api.limits(kind, subject["id"])
    if kind == "user":
        st.subheader(f"User {subject['name']}: use against the user's limits")
        _usage_table(_usage_rows(names, usage.get("user", {})))
        if "org" in usage:
            st.subheader("Their organization: all its users together")
            _usage_table(_usage_rows(names, usage["org"]))
    else:
        st.subheader(f"Organization {subject['name']}: all its users together")
        _usage_table(_usage_rows(names, usage.get("org", {})))
    _edit(api, kind, subject["id"], names, limits)
