"""The admin console's logic with Streamlit's AppTest (no browser) against a real gateway over
HTTP: sign-in (an admin key only), the operator's round trip (create an org, a user and a key,
set a quota, revoke the key: the key then gets 401), API errors shown as one line and never a
traceback, and every page's content after real training traffic."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from streamlit.testing.v1 import AppTest

from tests.console.conftest import APP, Gateway
from tests.gateway.harness import create_model, fwdbwd, model, session, wait_future
from tests.services import free_port

PAGES = {
    "Overview": "Overview",
    "Orgs & users": "Organizations and users",
    "Keys": "API keys",
    "Quotas": "Quotas",
    "Usage": "Usage",
    "Audit log": "Audit log",
    "Engine": "Engine",
}


def _start(url: str, key: str) -> AppTest:
    at = AppTest.from_file(APP, default_timeout=30)
    at.run()
    at.text_input[0].input(url)
    at.text_input[1].input(key)
    _button(at, "Sign in").click()
    at.run()
    _OPENED.append(at)
    return at


@pytest.fixture(autouse=True)
def _close_clients() -> Iterator[None]:
    """Close the console sessions' API clients (a session ends without signing out)."""
    yield
    for at in _OPENED:
        api = at.session_state["api"] if "api" in at.session_state else None  # noqa: SIM401
        if api is not None:
            api.close()
    _OPENED.clear()


_OPENED: list[AppTest] = []


def _signed_in(gw: Gateway, key: str | None = None) -> AppTest:
    at = _start(gw.url, key or gw.admin_key)
    assert not at.exception and not at.error, [e.value for e in at.error]
    assert at.sidebar.radio[0].value == "Overview"
    return at


def _button(at: AppTest, label: str):
    return next(b for b in at.button if b.label == label)


def _goto(at: AppTest, page: str) -> None:
    at.sidebar.radio[0].set_value(page)
    at.run()
    assert not at.exception, at.exception
    assert [t.value for t in at.title] == [PAGES[page]]


def _pick(at: AppTest, key: str, starts: str) -> None:
    box = at.selectbox(key=key)
    box.set_value(next(o for o in box.options if o.startswith(starts)))


def _texts(elements) -> str:
    return " | ".join(str(e.value) for e in elements)


def test_non_admin_unknown_and_unreachable_are_refused(gateway: Gateway) -> None:
    at = _start(gateway.url, gateway.key("nonadmin"))
    assert "not an admin key" in _texts(at.error)
    assert not at.sidebar.radio and [t.value for t in at.title] == ["Twinkle admin console"]
    at = _start(gateway.url, "tml-notakey")
    assert "does not accept this key" in _texts(at.error)
    at = _start(f"http://127.0.0.1:{free_port()}", gateway.admin_key)
    assert "cannot reach the gateway" in _texts(at.error)
    assert not at.exception


def test_create_user_and_key_set_quota_revoke(gateway: Gateway) -> None:
    at = _signed_in(gateway)
    _goto(at, "Orgs & users")
    at.text_input(key="new_org_name").input("acme-co")
    _button(at, "Create organization").click()
    at.run()
    assert "Created organization acme-co" in _texts(at.success)
    at.text_input(key="new_user_name").input("carol")
    at.selectbox(key="new_user_org").set_value("acme-co")
    _button(at, "Create user").click()
    at.run()
    assert "Created user carol" in _texts(at.success)
    users = at.dataframe[1].value
    assert users[users["Name"] == "carol"]["Organization"].tolist() == ["acme-co"]

    _goto(at, "Keys")
    _pick(at, "new_key_user", "carol ")
    at.text_input(key="new_key_name").input("laptop")
    _button(at, "Create key").click()
    at.run()
    assert "shown only once" in _texts(at.success)
    key = at.code[0].value
    assert key.startswith("tml-")
    with gateway.http(key) as c:
        me = c.get("/api/v1/auth/apikey/me")
        assert me.status_code == 200 and me.json()["details"]["org_details"]["name"] == "acme-co"
    at.run()  # the next run no longer shows the key
    assert not at.code and key not in _texts(at.markdown)
    keys = at.dataframe[0].value
    assert keys[keys["Prefix"] == key[:10] + "…"]["Status"].tolist() == ["active"]

    _goto(at, "Quotas")
    at.radio(key="quota_level").set_value("User")
    at.run()
    _pick(at, "quota_subject_user", "carol ")
    at.run()
    carol_id = int(at.selectbox(key="quota_subject_user").value.split("id ")[1].rstrip(")"))
    at.number_input(key=f"q_user_{carol_id}_max_training_clients").set_value(1)
    _button(at, "Save limits").click()
    at.run()
    assert "Saved: max_training_clients = 1" in _texts(at.success)
    with gateway.http(gateway.admin_key) as c:
        limits = c.get(f"/api/v1/admin/quotas/user/{carol_id}").json()["limits"]
    assert limits == {"max_training_clients": 1}
    # the quota holds for the key: a second training client is refused
    with gateway.http(key) as c:
        sid = session(c, key)  # an httpx.Client speaks TestClient's API
        model(c, key, sid)
        assert create_model(c, key, sid, 1).status_code == 403
    at.run()
    table = at.dataframe[0].value
    row = table[table["Quota"] == "max_training_clients"]
    assert row["Current"].tolist() == ["1"] and row["Limit"].tolist() == ["1"]

    _goto(at, "Keys")
    at.text_input(key="keys_prefix").input(key[:10])
    at.run()
    assert len(at.dataframe[0].value) == 1
    _pick(at, "revoke_key", key[:10])
    _button(at, "Revoke key").click()
    at.run()
    assert f"Revoked key {key[:10]}" in _texts(at.success)
    assert at.dataframe[0].value["Status"].tolist() == ["revoked"]
    with gateway.http(key) as c:
        assert c.get("/api/v1/auth/apikey/me").status_code == 401


def test_api_errors_are_one_line_never_a_traceback(gateway: Gateway) -> None:
    at = _signed_in(gateway)
    _goto(at, "Orgs & users")
    for _ in range(2):
        at.text_input(key="new_org_name").input("twice")
        _button(at, "Create organization").click()
        at.run()
    assert "409 Conflict: name: organization 'twice' already exists" in _texts(at.error)
    at.text_input(key="new_user_name").input("   ")
    _button(at, "Create user").click()
    at.run()
    assert "400" in _texts(at.error) and "name" in _texts(at.error)
    # the console's own admin key is revoked while signed in: the next page says so
    second = gateway.key("root2", org="ops", scope="admin")
    at = _signed_in(gateway, second)
    with gateway.http(gateway.admin_key) as c:
        kid = c.get("/api/v1/admin/keys", params={"prefix": second[:10]}).json()["keys"][0]["id"]
        assert c.post(f"/api/v1/admin/keys/{kid}/revoke").status_code == 200
    _goto(at, "Keys")
    assert _texts(at.error).startswith("401 Unauthorized")
    assert not at.exception


def test_every_page_after_real_traffic(gateway: Gateway) -> None:
    user_key = gateway.key("dave", org="traffic")
    at = _signed_in(gateway)
    with gateway.http(user_key) as c:
        mid = model(c, user_key)
        at.run()  # a first overview poll before the step
        fut = fwdbwd(c, user_key, mid, 1, 40).json()
        wait_future(c, user_key, fut)
    at.run()  # the second poll: rates between the two
    metrics = {m.label: m.value for m in at.metric}
    assert metrics["Models"] == "1" and metrics["Active tenants"] != "0"
    assert metrics["Tokens/s"] not in ("—", "0.0"), metrics
    assert metrics["Error rate"].endswith("%")
    assert at.dataframe[0].value["Model"].tolist() == ["twinkle/tiny-chat"]

    _goto(at, "Usage")
    table = at.dataframe[0].value
    dave = table[table["User"] == "dave"]
    assert dave["Training tokens"].sum() == 40 and dave["Organization"].tolist() == ["traffic"]
    # the CSV download holds the same rows as the table
    from admin_ui.views.usage import to_csv

    csv_text = to_csv(table.to_dict("records")).decode()
    header, *lines = csv_text.strip().splitlines()
    assert header.split(",")[:5] == [
        "Day", "Organization", "User", "Training tokens", "Sampling tokens"
    ]  # fmt: skip
    assert len(lines) == len(table) and any(",traffic,dave,40," in ln for ln in lines)

    _goto(at, "Engine")
    adapters = at.dataframe[-1].value
    assert adapters[adapters["Adapter (model id)"] == mid][["Owner", "State"]].values.tolist() == [
        ["dave", "loaded"]
    ]

    # enough audit entries for two pages: 6 x 9 quota changes for one org
    with gateway.http(gateway.admin_key) as c:
        org = c.post("/api/v1/admin/orgs", json={"name": "audited"}).json()
        names = c.get("/api/v1/admin/quotas").json()["quotas"]
        for v in range(1, 7):
            r = c.put(
                f"/api/v1/admin/quotas/org/{org['id']}", json={"limits": dict.fromkeys(names, v)}
            )
            assert r.status_code == 200
    _goto(at, "Audit log")
    at.multiselect(key="audit_events").select("quota_changed")
    at.selectbox(key="audit_org").set_value("audited")
    at.run()
    assert "Page 1 of 2 · 54 entries" in _texts(at.markdown)
    first = at.dataframe[0].value
    assert len(first) == 50 and set(first["Event"]) == {"quota_changed"}
    last = list(names)[-1]  # the newest entry: the last change of the last request
    assert first["Details"].iloc[0] == f"{last}: 5 → 6 (org {org['id']})"
    _button(at, "Older →").click()
    at.run()
    assert "Page 2 of 2" in _texts(at.markdown) and len(at.dataframe[0].value) == 4

    for page in PAGES:  # and nothing anywhere shows an error
        _goto(at, page)
        assert not at.error, (page, _texts(at.error))
