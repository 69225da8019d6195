"""The Twinkle admin console (Streamlit): sign-in with an admin key, then one page at a time.

Start it with ``twinkle console`` (gateway/cli/console.py), or directly with
``streamlit run admin_ui/app.py`` (the gateway URL from ``TWINKLE_GATEWAY_URL``). The key is
checked against ``GET /api/v1/admin/whoami``: a non-admin key (403), an unknown or revoked one
(401) and an unreachable gateway are refused with one clear sentence. Every page talks only to
the gateway's admin REST API through `admin_ui.client.AdminClient`; an `ApiError` is shown as an
error box, and anything unexpected as one line too (never a traceback).
"""

from __future__ import annotations

import os

import streamlit as st

from admin_ui.client import AdminClient, ApiError
from admin_ui.views import PAGES

DEFAULT_GATEWAY = "http://127.0.0.1:8000"


def _refusal(exc: ApiError) -> str:
    if exc.status == 403:
        return (
            "This key is not an admin key. The console needs an admin-scope key "
            "(`twinkle keys create --admin ...`)."
        )
    if exc.status == 401:
        return "The gateway does not accept this key (unknown, revoked or expired)."
    return f"Sign-in failed: {exc.message}"


def sign_in() -> None:
    st.title("Twinkle admin console")
    st.caption("Sign in with an admin API key. The console talks only to the gateway's admin API.")
    default_url = os.environ.get("TWINKLE_GATEWAY_URL", DEFAULT_GATEWAY)
    with st.form("sign_in"):
        url = st.text_input("Gateway URL", value=st.session_state.get("gateway_url", default_url))
        key = st.text_input("Admin API key", type="password", placeholder="tml-...")
        submitted = st.form_submit_button("Sign in", type="primary")
    if not submitted:
        return
    url, key = (url or "").strip(), (key or "").strip()
    if not key:
        st.error("Enter an admin API key.")
        return
    api = AdminClient(url, key)
    try:
        who = api.whoami()
    except ApiError as exc:
        api.close()
        st.error(_refusal(exc))
        return
    st.session_state.update(api=api, who=who, gateway_url=url, page=next(iter(PAGES)))
    st.rerun()


def sign_out() -> None:
    api = st.session_state.pop("api", None)
    if api is not None:
        api.close()
    for name in ("who", "history", "new_key"):
        st.session_state.pop(name, None)


def main() -> None:
    st.set_page_config(page_title="Twinkle admin", page_icon="🧶", layout="wide")
    api: AdminClient | None = st.session_state.get("api")
    if api is None:
        sign_in()
        return
    who = st.session_state["who"]
    with st.sidebar:
        st.markdown("### Twinkle admin")
        org = f" ({who['org']})" if who.get("org") else ""
        st.caption(f"{who['user']}{org} · key `{who['key_prefix']}…`  \n{api.base_url}")
        page = st.radio("Page", list(PAGES), key="page", label_visibility="collapsed")
        st.button("Sign out", on_click=sign_out)
    try:
        PAGES[page](api)
    except ApiError as exc:
        st.error(exc.message)
    except Exception as exc:  # a console bug must not show a traceback to the operator
        st.error(f"The console failed on this page: {type(exc).__name__}: {exc}")


main()
