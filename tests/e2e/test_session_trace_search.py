"""Session traces and session search through the unmodified tinker 0.38.0 SDK against
`twinkle serve`: export_session_trace (pending → ready, a signed URL, a Chrome trace with every
request, no key and no payload in it, another user's session refused) and search_sessions
(filters, pages, owners; our extra filters over raw HTTP; bad input is a 400)."""

from __future__ import annotations

import json
import warnings
from datetime import UTC, datetime, timedelta

import httpx
import pytest
import tinker
from tinker import types

pytestmark = pytest.mark.e2e
BASE = "twinkle/tiny-chat"
SEQ = [11, 42, 77, 103, 250, 31, 9, 460, 88]
DATA = [
    types.Datum(
        model_input=types.ModelInput.from_ints(SEQ[:-1]),
        loss_fn_inputs={"target_tokens": SEQ[1:], "weights": [1.0] * (len(SEQ) - 1)},
    )
]


def _search(rest: tinker.RestClient, **kw) -> types.SessionSearchResponse:
    with warnings.catch_warnings():  # the SDK marks search_sessions experimental
        warnings.simplefilter("ignore")
        return rest.search_sessions(types.SessionSearchRequest(**kw)).result()


@pytest.fixture(scope="module")
def alice(server):
    key = server.create_key("trace-alice")
    sc = tinker.ServiceClient(
        base_url=server.url,
        api_key=key,
        display_name="Nightly SFT run",
        user_metadata={"team": "vision", "note": "Sweep-Alpha"},
    )
    tc = sc.create_lora_training_client(base_model=BASE, rank=4, seed=3).result()
    for _ in range(2):
        tc.forward_backward(DATA, "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    bad = types.Datum(
        model_input=types.ModelInput.from_ints(SEQ[:-1]),
        loss_fn_inputs={"target_tokens": SEQ[1:3], "weights": [1.0, 1.0]},  # wrong length
    )
    with pytest.raises(tinker.RequestFailedError):
        tc.forward_backward([bad], "cross_entropy").result()
    sampler = tc.save_weights_and_get_sampling_client().result()
    sampler.sample(
        types.ModelInput.from_ints(SEQ[:4]), 1, types.SamplingParams(max_tokens=3)
    ).result()
    yield sc, tinker.RestClient(base_url=server.url, api_key=key), key, tc
    sc.close("success")


@pytest.fixture(scope="module")
def bob(server):
    key = server.create_key("trace-bob")
    sc = tinker.ServiceClient(base_url=server.url, api_key=key, display_name="nightly eval")
    sc.create_lora_training_client(base_model=BASE, rank=4).result()
    yield sc, tinker.RestClient(base_url=server.url, api_key=key), key
    sc.close("success")


def test_trace_export_lists_every_request_without_keys_or_payloads(server, alice, bob):
    sc, rest, key, tc = alice
    session_id = sc.holder.get_session_id()
    url = rest.export_session_trace(session_id).result()  # pending, then ready (SDK polls)
    assert url.startswith(server.url) and "sig=" in url
    r = httpx.get(url, timeout=30)  # no API key: the signature is the credential
    assert r.status_code == 200, r.text
    doc = json.loads(r.text)
    events = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    kinds = [e["name"] for e in events]
    assert kinds.count("forward_backward") == 3 and kinds.count("optim_step") == 2
    assert {"create_model", "save", "sample"} <= set(kinds)
    failed = [e for e in events if e["args"]["status"] != "ok"]
    assert len(failed) == 1 and failed[0]["args"]["error_category"] == "user"
    assert "target_tokens" in failed[0]["args"]["error"]  # the message names the field
    training = [e for e in events if e["cat"] == "training"]
    assert all(e["args"]["queued_behind_previous_ms"] >= 0 for e in training)
    assert all(e["dur"] >= 0 for e in events) and doc["otherData"]["failed"] == 1
    tracks = {e["args"]["name"] for e in doc["traceEvents"] if e["name"] == "thread_name"}
    assert tc.model_id in tracks
    # no key, key prefix, user name or token payload in the file
    for secret in (key, key[:12], "trace-alice", json.dumps(SEQ[1:])):
        assert secret not in r.text
    bad = url.replace("sig=", "sig=0")
    assert httpx.get(bad, timeout=30).status_code == 403
    _, bob_rest, _ = bob
    with pytest.raises(tinker.NotFoundError):
        bob_rest.export_session_trace(session_id).result()


def test_search_sessions_filters_pages_and_owners(server, alice, bob):
    a_sc, a_rest, _, _ = alice
    b_sc, b_rest, _ = bob
    a_id, b_id = a_sc.holder.get_session_id(), b_sc.holder.get_session_id()
    # by name words (case-insensitive), metadata pairs, status; only the caller's own sessions
    page = _search(a_rest, display_name="nightly SFT")
    assert [s.session_id for s in page.sessions] == [a_id]
    got = page.sessions[0]
    assert got.owner.startswith("tml:user:") and got.user_metadata == {
        "team": "vision",
        "note": "Sweep-Alpha",
    }
    assert got.status is not None and got.status.type == "active"
    assert got.checkpoints_count >= 1 and (got.checkpoint_storage_bytes or 0) > 0
    assert _search(a_rest, display_name="nightly eval").sessions == []  # bob's: never alice's
    assert [s.session_id for s in _search(a_rest, user_metadata={"team": "vision"}).sessions] == [
        a_id
    ]
    assert _search(a_rest, user_metadata={"team": "text"}).sessions == []
    finished = [types.ClientFinishedSessionStatusQuery()]
    assert _search(a_rest, statuses=finished).sessions == []
    # a user key: "accessible" is still only its own; another user's URN is refused
    seen = _search(b_rest, owner=types.AccessibleSearchOwner()).sessions
    assert {s.session_id for s in seen} == {b_id}
    with pytest.raises(tinker.PermissionDeniedError, match="owner.owner_urns"):
        _search(b_rest, owner=types.UserSearchOwner(owner_urns=[got.owner]))
    # an admin key sees both; pages of one, newest first, chained by next_cursor
    admin = tinker.RestClient(base_url=server.url, api_key=server.create_key("trace-admin", True))
    req = {"owner": types.AccessibleSearchOwner(), "display_name": "nightly", "limit": 1}
    first = _search(admin, **req)
    assert len(first.sessions) == 1 and first.next_cursor is not None
    second = _search(admin, **req, cursor=first.next_cursor)
    assert {first.sessions[0].session_id, second.sessions[0].session_id} == {a_id, b_id}
    assert first.sessions[0].created_at >= second.sessions[0].created_at
    assert second.next_cursor is None


def test_search_extra_filters_and_bad_input_over_http(server, alice):
    sc, _, key, _ = alice
    a_id = sc.holder.get_session_id()
    url, headers = f"{server.url}/api/v1/sessions/search", {"X-API-Key": key}

    def ids(body: dict) -> list[str]:
        r = httpx.post(url, json=body, headers=headers, timeout=30)
        assert r.status_code == 200, r.text
        return [s["session_id"] for s in r.json()["sessions"]]

    hour = timedelta(hours=1)
    now = datetime.now(UTC)
    assert ids({"created_after": (now - hour).isoformat(), "base_model": BASE}) == [a_id]
    assert ids({"created_after": (now + hour).isoformat()}) == []
    assert ids({"created_before": (now - hour).isoformat()}) == []
    assert ids({"base_model": "no/such-model"}) == []
    assert ids({"metadata_text": "sweep-alpha"}) == [a_id]  # any value, case-insensitive
    for body, field in (
        ({"limit": 0}, "limit"),
        ({"owner": {"type": "user", "owner_urns": ["bob"]}}, "owner"),
        ({"statuses": [{"type": "sleeping"}]}, "statuses"),
    ):
        r = httpx.post(url, json=body, headers=headers, timeout=30)
        assert r.status_code in (400, 422), r.text
        assert field in r.text
    assert httpx.post(url, json={}, timeout=30).status_code == 401
