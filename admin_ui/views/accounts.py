"""Orgs & users page: list organizations and users; create, disable and enable them.

Sources: ``GET/POST /api/v1/admin/orgs``, ``PATCH /api/v1/admin/orgs/{id}``,
``GET/POST /api/v1/admin/users``, ``PATCH /api/v1/admin/users/{id}``. Disabling takes effect on
the subject's next request (its keys get 401 until enabled again).
"""

from __future__ import annotations

import pandas as pd
import streamlit as st

from admin_ui import fmt
from admin_ui.client import AdminClient, ApiError

NO_ORG = "(no organization)"


def _flash() -> None:
    """The result of the last change, kept across the rerun that shows the new lists."""
    msg = st.session_state.pop("accounts_flash", None)
    if msg:
        st.success(msg)


def _done(msg: str) -> None:
    st.session_state["accounts_flash"] = msg
    st.rerun()


def _orgs(api: AdminClient, orgs: list[dict]) -> None:
    st.subheader("Organizations")
    rows = [
        {
            "ID": o["id"],
            "Name": o["name"],
            "Status": fmt.status(o["disabled"]),
            "Created": fmt.when(o["created_at"]),
        }
        for o in orgs
    ]
    if rows:
        st.dataframe(pd.DataFrame(rows), hide_index=True, width="stretch")
    else:
        st.info("No organizations yet.")
    left, right = st.columns(2)
    with left, st.form("create_org", clear_on_submit=True):
        st.markdown("**Create an organization**")
        name = st.text_input("Organization name", key="new_org_name")
        if st.form_submit_button("Create organization"):
            try:
                org = api.create_org(name)
            except ApiError as exc:
                st.error(exc.message)
            else:
                _done(f"Created organization {org['name']} (id {org['id']}).")
    with right:
        _toggle(
            "org",
            orgs,
            lambda o: f"{o['name']} (id {o['id']}, {fmt.status(o['disabled'])})",
            api.set_org_disabled,
        )


def _users(api: AdminClient, users: list[dict], orgs: list[dict]) -> None:
    st.subheader("Users")
    org_names = fmt.names(orgs)
    rows = [
        {
            "ID": u["id"],
            "Name": u["name"],
            "Organization": org_names.get(u["org_id"], "") if u["org_id"] is not None else "",
            "Admin": u["is_admin"],
            "Status": fmt.status(u["disabled"]),
            "Created": fmt.when(u["created_at"]),
        }
        for u in users
    ]
    if rows:
        st.dataframe(pd.DataFrame(rows), hide_index=True, width="stretch")
    else:
        st.info("No users yet.")
    left, right = st.columns(2)
    with left, st.form("create_user", clear_on_submit=True):
        st.markdown("**Create a user**")
        name = st.text_input("User name", key="new_user_name")
        org = st.selectbox("Organization", [NO_ORG, *(o["name"] for o in orgs)], key="new_user_org")
        admin = st.checkbox("Administrator", key="new_user_admin")
        if st.form_submit_button("Create user"):
            try:
                user = api.create_user(name, None if org == NO_ORG else org, admin)
            except ApiError as exc:
                st.error(exc.message)
            else:
                _done(f"Created user {user['name']} (id {user['id']}).")
    with right:
        _toggle(
            "user",
            users,
            lambda u: f"{u['name']} (id {u['id']}, {fmt.status(u['disabled'])})",
            api.set_user_disabled,
        )


def _toggle(kind: str, rows: list[dict], label, set_disabled) -> None:
    """Disable or enable one org or user."""
    st.markdown(f"**Disable or enable a{'n' if kind == 'org' else ''} {kind}**")
    if not rows:
        st.caption("Nothing to change yet.")
        return
    by_label = {label(r): r for r in rows}
    choice = st.selectbox(kind.capitalize(), list(by_label), key=f"toggle_{kind}")
    row = by_label[choice]
    verb = "Enable" if row["disabled"] else "Disable"
    if st.button(f"{verb} {kind}", key=f"toggle_{kind}_button"):
        try:
            set_disabled(row["id"], not row["disabled"])
        except ApiError as exc:
            st.error(exc.message)
        else:
            _done(f"{verb}d {kind} {row['name']}.")


def render(api: AdminClient) -> None:
    st.title("Organizations and users")
    _flash()
    orgs = api.orgs()
    users = api.users()
    _orgs(api, orgs)
    st.divider()
    _users(api, users, orgs)
