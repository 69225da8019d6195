"""The real tinker SDK (0.38.0) against the real gateway app served over HTTP by uvicorn in this
process (in-process engine on the tiny model, real SQLite): JWT mode (POST /api/v1/auth/token,
whoami), revoking a key revokes its JWTs and fails a running session's next request with 401,
and the AdminClient's audit / billing / storage calls."""

from __future__ import annotations

import threading
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
import tinker
import uvicorn
from tinker import types

from tests.gateway.harness import BASE, build_engines, make_app, new_key, sqlite_url
from tests.services import free_port


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    data = Path(tmp_path_factory.mktemp("sdk"))
    db_url = sqlite_url(data)
    engines = build_engines(data, 1)[0]
    app = make_app(data, db_url, engines, gateway={"jwt_enabled": True, "jwt_ttl_seconds": 300})
    port = free_port()
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    t = threading.Thread(target=srv.run, daemon=True)
    t.start()
    deadline = time.monotonic() + 60
    while not srv.started and time.monotonic() < deadline:
        time.sleep(0.1)
    assert srv.started
    yield {"url": f"http://127.0.0.1:{port}", "db_url": db_url}
    srv.should_exit = True
    t.join(30)


def _datum() -> types.Datum:
    return types.Datum(
        model_input=types.ModelInput.from_ints([1, 2, 3, 4]),
        loss_fn_inputs={"target_tokens": [2, 3, 4, 5], "weights": [1.0] * 4},
    )


def test_jwt_whoami_and_revocation_stops_a_running_session(server) -> None:
    key = new_key(server["db_url"], "alice", org="acme")
    admin = new_key(server["db_url"], "root", org="ops", scope="admin")
    sc = tinker.ServiceClient(base_url=server["url"], api_key=key)
    who = sc.create_rest_client().whoami().result()
    assert who.user_urn.startswith("tml:user:") and who.org_urn.startswith("tml:organization:")
    assert who.org_urn != "tml:organization:0"
    tc = sc.create_lora_training_client(base_model=BASE, rank=4)
    out = tc.forward_backward([_datum()], "cross_entropy").result()
    assert out.metrics["loss:sum"] > 0
    # revoke the key through the admin API: the session's next request (with a live JWT) fails
    import httpx

    hdr = {"X-API-Key": admin}
    keys = httpx.get(f"{server['url']}/api/v1/admin/keys", headers=hdr).json()["keys"]
    kid = next(k["id"] for k in keys if k["prefix"] == key[:10])
    assert (
        httpx.post(f"{server['url']}/api/v1/admin/keys/{kid}/revoke", headers=hdr).status_code
        == 200
    )
    with pytest.raises(tinker.AuthenticationError):
        tc.forward_backward([_datum()], "cross_entropy").result()


def test_sdk_refreshes_its_jwt_with_its_api_key(server) -> None:
    """The server exchanges only API keys for JWTs: the SDK's refresh (what its background loop
    and its invalid_token replay run) still gets a fresh JWT, which the next step uses."""
    from tinker.lib._jwt_auth import JwtAuthProvider, jwt_claims

    key = new_key(server["db_url"], "refresher", org="acme")
    sc = tinker.ServiceClient(base_url=server["url"], api_key=key)
    tc = sc.create_lora_training_client(base_model=BASE, rank=4)
    provider = sc.holder._default_auth
    assert isinstance(provider, JwtAuthProvider)
    first = sc.holder.run_coroutine_threadsafe(provider.get_token()).result()
    time.sleep(1.1)  # a later iat, so the refreshed token differs
    fresh = sc.holder.run_coroutine_threadsafe(provider._fetch()).result()
    assert fresh != first and jwt_claims(fresh)["iat"] > jwt_claims(first)["iat"]
    assert tc.forward_backward([_datum()], "cross_entropy").result().metrics["loss:sum"] > 0


def test_admin_client_usage_storage_and_audit(server) -> None:
    admin = new_key(server["db_url"], "root2", org="acme2", scope="admin")
    user = new_key(server["db_url"], "bob", org="acme2")
    sc = tinker.ServiceClient(base_url=server["url"], api_key=user)
    tc = sc.create_lora_training_client(base_model=BASE, rank=4)
    tc.forward_backward([_datum()], "cross_entropy").result()
    tc.save_state("ck1").result()
    ac = tinker.AdminClient(base_url=server["url"], api_key=admin)
    hour = datetime.now(UTC).replace(minute=0, second=0, microsecond=0)
    usage = ac.get_billing_usage(hour - timedelta(hours=1), hour + timedelta(hours=1)).result()
    kinds = {e.event_info.type: e for e in usage.data}
    assert kinds["training"].event_info.token_count == 4
    assert kinds["checkpoint"].event_info.count == 1
    assert kinds["training"].base_model == BASE
    storage = ac.get_current_checkpoint_storage_usage().result()
    (item,) = storage.data  # only this organization's checkpoints
    assert item.checkpoint_count == 1 and item.size_bytes > 0 and item.user_name == "bob"
    audit = ac.get_audit_log().result()
    events = {e.event for e in audit.entries}
    assert {"key_created", "user_created"} <= events
    # a user key is not an admin
    with pytest.raises(tinker.PermissionDeniedError):
        tinker.AdminClient(base_url=server["url"], api_key=user).get_audit_log().result()
