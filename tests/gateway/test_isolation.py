"""The isolation matrix: for every object type (sessions, models / training runs, futures,
samplers, checkpoints) and every verb on it, tenant B using tenant A's id gets 404 (admin routes:
403) and nothing of A's changes (DB rows compared before and after; A keeps working). A published
checkpoint can be sampled and loaded by B, but deleted only by its owner."""

from __future__ import annotations

import pytest
from sqlalchemy import text

from gateway.db import make_engine
from tests.gateway.harness import BASE, fwdbwd, model, session, wait_future

ENGINE_BACKEND = "mock"  # HTTP semantics only (tests/gateway/conftest.py)


@pytest.fixture(scope="module")
def world(make_gateway):
    with make_gateway() as gw:
        c, db_url = gw.client, gw.db_url
        a = gw.key("alice", org="org-a")
        b = gw.key("bob", org="org-b")
        ha = {"X-API-Key": a}
        sid = session(c, a)
        mid = model(c, a, sid)
        fut = fwdbwd(c, a, mid, 1).json()
        wait_future(c, a, fut)
        saved = c.post(
            "/api/v1/save_weights", headers=ha, json={"model_id": mid, "seq_id": 2, "path": "ck"}
        ).json()
        path = wait_future(c, a, saved)["path"]
        sp = c.post(
            "/api/v1/save_weights_for_sampler",
            headers=ha,
            json={"model_id": mid, "seq_id": 3, "path": "sp"},
        ).json()
        sampler_path = wait_future(c, a, sp)["path"]
        smp = c.post(
            "/api/v1/create_sampling_session",
            headers=ha,
            json={"session_id": sid, "sampling_session_seq_id": 0, "model_path": sampler_path},
        ).json()["sampling_session_id"]
        yield {
            "c": c,
            "a": a,
            "b": b,
            "sid": sid,
            "mid": mid,
            "fut": fut["request_id"],
            "path": path,
            "sampler_path": sampler_path,
            "sampler": smp,
            "db_url": db_url,
            "next_seq": 4,
        }


def _snapshot(db_url: str) -> dict:
    eng = make_engine(db_url)
    try:
        with eng.connect() as conn:
            return {
                t: sorted(tuple(map(str, r)) for r in conn.execute(text(f"SELECT * FROM {t}")))
                for t in (
                    "sessions",
                    "training_runs",
                    "checkpoints",
                    "sampling_sessions",
                    "api_keys",
                )
            }
    finally:
        eng.dispose()


PROMPT = {"chunks": [{"type": "encoded_text", "tokens": [5, 6, 7]}]}
SP = {"max_tokens": 2, "temperature": 0}


def _cases(w) -> list[tuple[str, str, str, dict | None]]:
    """(label, method, url, json body) for B aimed at A's objects."""
    sid, mid, path, smp = w["sid"], w["mid"], w["path"], w["sampler"]
    run_ckpt = f"/api/v1/training_runs/{mid}/checkpoints/weights/ck"
    return [
        ("session heartbeat", "POST", "/api/v1/session_heartbeat", {"session_id": sid}),
        ("session finish", "POST", f"/api/v1/sessions/{sid}/finish", {}),
        (
            "session create_model",
            "POST",
            "/api/v1/create_model",
            {"session_id": sid, "model_seq_id": 7, "base_model": BASE, "lora_config": {"rank": 4}},
        ),
        (
            "session create_sampling_session",
            "POST",
            "/api/v1/create_sampling_session",
            {"session_id": sid, "sampling_session_seq_id": 9, "base_model": BASE},
        ),
        ("model get_info", "POST", "/api/v1/get_info", {"model_id": mid}),
        (
            "model optim_step",
            "POST",
            "/api/v1/optim_step",
            {"model_id": mid, "seq_id": w["next_seq"], "adam_params": {"learning_rate": 0.1}},
        ),
        (
            "model save_weights",
            "POST",
            "/api/v1/save_weights",
            {"model_id": mid, "seq_id": w["next_seq"], "path": "evil", "overwrite": True},
        ),
        (
            "model save_weights_for_sampler",
            "POST",
            "/api/v1/save_weights_for_sampler",
            {"model_id": mid, "seq_id": w["next_seq"], "path": "evil"},
        ),
        (
            "model load_weights in place",
            "POST",
            "/api/v1/load_weights",
            {"model_id": mid, "seq_id": w["next_seq"], "path": path},
        ),
        ("run get", "GET", f"/api/v1/training_runs/{mid}", None),
        (
            "run get, access_scope=accessible",
            "GET",
            f"/api/v1/training_runs/{mid}?access_scope=accessible",
            None,
        ),
        ("run checkpoints", "GET", f"/api/v1/training_runs/{mid}/checkpoints", None),
        ("checkpoint delete", "DELETE", run_ckpt, None),
        (
            "checkpoint load into new model",
            "POST",
            "/api/v1/load_weights",
            {"path": path, "session_id": sid, "model_seq_id": 8},
        ),
        ("future retrieve", "POST", "/api/v1/retrieve_future", {"request_id": w["fut"]}),
        ("sampler get", "GET", f"/api/v1/samplers/{smp}", None),
        (
            "sampler asample",
            "POST",
            "/api/v1/asample",
            {
                "sampling_session_id": smp,
                "seq_id": 1,
                "num_samples": 1,
                "prompt": PROMPT,
                "sampling_params": SP,
            },
        ),
        (
            "checkpoint sample by path",
            "POST",
            "/api/v1/asample",
            {
                "model_path": w["sampler_path"],
                "num_samples": 1,
                "prompt": PROMPT,
                "sampling_params": SP,
            },
        ),
        (
            "checkpoint sampling session by path",
            "POST",
            "/api/v1/create_sampling_session",
            {"session_id": "x", "sampling_session_seq_id": 0, "model_path": w["sampler_path"]},
        ),
        (
            "checkpoint openai completion",
            "POST",
            "/v1/completions",
            {"model": w["sampler_path"], "prompt": "hi", "max_tokens": 2},
        ),
        ("checkpoint openai model card", "GET", f"/v1/models/{w['sampler_path']}", None),
        (
            "checkpoint openai chat",
            "POST",
            "/v1/chat/completions",
            {"model": w["sampler_path"], "messages": [{"role": "user", "content": "hi"}]},
        ),
    ]


def test_tenant_b_gets_404_for_every_verb_on_tenant_a_objects(world) -> None:
    c, hb = world["c"], {"X-API-Key": world["b"]}
    b_sid = session(c, world["b"])
    before = _snapshot(world["db_url"])
    failures = []
    for label, method, url, body in _cases(world):
        if body and body.get("session_id") == "x":
            body = {**body, "session_id": b_sid}  # B's own session, A's checkpoint
        r = c.request(method, url, json=body, headers=hb)
        if r.status_code != 404 or r.json()["detail"] == "Not Found":  # not a missing route
            failures.append((label, r.status_code, r.text[:200]))
        else:  # ids leak nothing: the answer names only what B sent
            assert "alice" not in r.text and "org-a" not in r.text
    assert failures == []
    assert _snapshot(world["db_url"]) == before
    # the forward_backward body is protobuf: same rule
    r = fwdbwd(c, world["b"], world["mid"], world["next_seq"])
    assert r.status_code == 404
    assert _snapshot(world["db_url"]) == before
    # A is unaffected: its session, model (next seq) and checkpoint still work
    ha = {"X-API-Key": world["a"]}
    assert (
        c.post(
            "/api/v1/session_heartbeat", json={"session_id": world["sid"]}, headers=ha
        ).status_code
        == 200
    )
    r = fwdbwd(c, world["a"], world["mid"], world["next_seq"])
    assert r.status_code == 200 and wait_future(c, world["a"], r.json()).status_code == 200
    world["next_seq"] += 1
    assert c.get(f"/api/v1/training_runs/{world['mid']}/checkpoints", headers=ha).json()[
        "checkpoints"
    ]


def test_user_keys_get_403_on_admin_routes(world) -> None:
    c, hb = world["c"], {"X-API-Key": world["b"]}
    for method, url in [
        ("GET", "/api/v1/admin/orgs"),
        ("GET", "/api/v1/admin/keys"),
        ("POST", "/api/v1/admin/keys/1/revoke"),
        ("GET", "/api/v1/admin/engine"),
        ("PUT", "/api/v1/admin/quotas/org/1"),
        ("GET", "/api/v1/audit"),
        ("GET", "/api/v1/billing/usage/checkpoints/current"),
    ]:
        r = c.request(method, url, headers=hb, json={"limits": {}} if method == "PUT" else None)
        assert r.status_code == 403, (url, r.text)


def test_published_checkpoint_is_readable_by_all_but_changed_only_by_its_owner(world) -> None:
    c, hb = world["c"], {"X-API-Key": world["b"]}
    eng = make_engine(world["db_url"])
    try:
        with eng.begin() as conn:
            conn.execute(
                text("UPDATE checkpoints SET public = true WHERE tinker_path IN (:a, :b)"),
                {"a": world["path"], "b": world["sampler_path"]},
            )
    finally:
        eng.dispose()
    r = c.post(
        "/api/v1/asample",
        headers=hb,
        json={
            "model_path": world["sampler_path"],
            "num_samples": 1,
            "prompt": PROMPT,
            "sampling_params": SP,
        },
    )
    assert r.status_code == 200, r.text
    b_sid = session(c, world["b"])
    r = c.post(
        "/api/v1/load_weights",
        headers=hb,
        json={"path": world["path"], "session_id": b_sid, "model_seq_id": 0},
    )
    assert r.status_code == 200, r.text
    assert wait_future(c, world["b"], r.json())["model_id"].startswith(b_sid)
    r = c.delete(f"/api/v1/training_runs/{world['mid']}/checkpoints/weights/ck", headers=hb)
    assert r.status_code == 404
    ha = {"X-API-Key": world["a"]}
    assert (
        world["path"] in c.get(f"/api/v1/training_runs/{world['mid']}/checkpoints", headers=ha).text
    )
