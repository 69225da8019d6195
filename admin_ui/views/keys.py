"""Keys page: list keys (filtered by prefix or user), create one (the key is shown once, right
after creation, and never again: the gateway keeps only its digest), revoke one.

Sources: ``GET /api/v1/admin/keys?prefix=&user_id=``, ``POST /api/v1/admin/keys``,
``POST /api/v1/admin/keys/{id}/revoke``, ``GET /api/v1/admin/users``.
"""

from __future__ import annotations

import pandas as pd
import streamlit as st

from admin_ui import fmt
from admin_ui.client import AdminClient, ApiError

ALL = "(all users)"
#: "Expires" choices: seconds (None = never)
EXPIRY = {"never": None, "1 day": 86400, "7 days": 7 * 86400, "30 days": 30 * 86400,
          "90 days": 90 * 86400, "1 year": 365 * 86400}  # fmt: skip


def _created(api: AdminClient, users: list[dict]) -> None:
    with st.form("create_key", clear_on_submit=True):
        st.markdown("**Create a key**")
        by_label = {f"{u['name']} (id {u['id']})": u for u in users}
        c1, c2, c3, c4 = st.columns(4)
        who = c1.selectbox("User", list(by_label), key="new_key_user")
        name = c2.text_input("Key name (optional)", key="new_key_name")
        scope = c3.selectbox("Scope", ["user", "admin"], key="new_key_scope")
        expires = c4.selectbox("Expires", list(EXPIRY), key="new_key_expires")
        if st.form_submit_button("Create key", type="primary") and who is not None:
            try:
                created = api.create_key(by_label[who]["id"], scope, name, EXPIRY[expires])
            except ApiError as exc:
                st.error(exc.message)
            else:
                st.success(
                    f"Created {created['scope']} key {created['prefix']}… for {created['user']}. "
                    "Copy it now: it is shown only once."
                )
                st.code(created["key"], language=None)


def _revoke(api: AdminClient, keys: list[dict]) -> None:
    st.markdown("**Revoke a key**")
    active = [k for k in keys if fmt.key_status(k) == "active"]
    if not active:
        st.caption("No active key in this list.")
        return
    by_label = {f"{k['prefix']}… · {k['user']} · {k['name'] or 'unnamed'}": k for k in active}
    c1, c2 = st.columns([3, 1])
    choice = c1.selectbox("Key", list(by_label), key="revoke_key", label_visibility="collapsed")
    if c2.button("Revoke key", key="revoke_key_button") and choice is not None:
        key = by_label[choice]
        try:
            api.revoke_key(key["id"])
        except ApiError as exc:
            st.error(exc.message)
        else:
            st.session_state["keys_flash"] = f"Revoked key {key['prefix']}… of {key['user']}."
            st.rerun()


def render(api: AdminClient) -> None:
    st.title("API keys")
    flash = st.session_state.pop("keys_flash", None)
    if flash:
        st.success(flash)
    users = api.users()
    user_by_label = {f"{u['name']} (id {u['id']})": u for u in users}
    c1, c2 = st.columns(2)
    prefix = c1.text_input("Prefix starts with", placeholder="tml-", key="keys_prefix")
    user = c2.selectbox("User", [ALL, *user_by_label], key="keys_user")
    user_id = None if user in (ALL, None) else user_by_label[user]["id"]
    keys = api.keys(prefix=prefix.strip() or None, user_id=user_id)
    rows = [
        {
            "Prefix": f"{k['prefix']}…",
            "Name": k["name"] or "",
            "User": k["user"] or "",
            "Scope": k["scope"],
            "Status": fmt.key_status(k),
            "Created": fmt.when(k["created_at"]),
            "Expires": fmt.when(k["expires_at"]) or "never",
            "Revoked": fmt.when(k["revoked_at"]),
        }
        for k in keys
    ]
    st.caption(f"{len(rows)} key(s). Keys are listed by prefix; the full key is never shown again.")
    if rows:
        st.dataframe(pd.DataFrame(rows), hide_index=True, width="stretch")
    st.divider()
    if users:
        _created(api, users)
    else:
        st.info("Create a user first (Orgs & users).")
    _revoke(api, keys)
