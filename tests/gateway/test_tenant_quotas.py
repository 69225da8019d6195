"""Every path that creates an adapter, a checkpoint or a stored row goes through the same quota
accounting, on the real gateway app and DB (mock engine backend: HTTP and quota semantics only):
native loads into new adapter names, finished sessions' adapters, ephemeral sampler saves,
copy_weights, stored custom losses / metadata / traces, and sampling sessions on a checkpoint that
stops being readable."""

from __future__ import annotations

import json
import time

from tests.gateway.harness import BASE, set_quota

ENGINE_BACKEND = "mock"
M = f"/api/v1/model/{BASE}/twinkle"
LORA8 = json.dumps({"_TWINKLE_TYPE_": "LoraConfig", "r": 8, "target_modules": "all-linear"})


class Native:
    """A native (twinkle_client protocol) user with one session and its model created."""

    def __init__(self, gw, user: str) -> None:
        self.gw, self.key = gw, gw.key(user)
        r = gw.client.post("/api/v1/twinkle/create_session", json={}, headers=self.h())
        assert r.status_code == 200, r.text
        self.session = r.json()["session_id"]
        self.post("create")

    def h(self) -> dict:
        h = {"Authorization": f"Bearer {self.key}"}
        if getattr(self, "session", None):
            h["X-Twinkle-Session-Id"] = self.session
        return h

    def post(self, method: str, body: dict | None = None, ok: bool = True):
        r = self.gw.client.post(f"{M}/{method}", json=body or {}, headers=self.h())
        if ok:
            assert r.status_code == 200, r.text
            return r.json()
        return r


def test_native_loads_into_new_adapter_names_take_training_client_slots(make_gateway):
    """A load / resume_from_checkpoint into an adapter name the model lacks creates an adapter:
    it takes a max_training_clients slot (403 at the cap) and is under max_lora_rank, as
    add_adapter_to_model is. A load into an existing adapter takes nothing more."""
    gw = make_gateway()
    u = Native(gw, "carol")
    set_quota(gw.db_url, "user", "carol", "max_training_clients", 2)
    u.post("add_adapter_to_model", {"adapter_name": "a", "config": LORA8})
    path = u.post("save", {"name": "c1", "adapter_name": "a"})["twinkle_path"]
    u.post("load", {"name": path, "adapter_name": "a"})  # in place: no new slot
    u.post("load", {"name": path, "adapter_name": "b"})  # the second slot
    for method in ("load", "resume_from_checkpoint"):
        over = u.post(method, {"name": path, "adapter_name": f"x-{method}"}, ok=False)
        assert over.status_code == 403, over.text
        assert "max_training_clients" in over.text and "limit 2" in over.text
    runs = gw.client.get("/api/v1/twinkle/training_runs", headers=u.h()).json()["training_runs"]
    assert len(runs) == 2  # the refused loads left no run behind
    # the rank cap holds for a load's adapter too (the checkpoint's rank is 8)
    set_quota(gw.db_url, "user", "carol", "max_training_clients", None)
    set_quota(gw.db_url, "user", "carol", "max_lora_rank", 4)
    r = u.post("load", {"name": path, "adapter_name": "c"}, ok=False)
    assert r.status_code == 403 and "max_lora_rank" in r.text, r.text
    set_quota(gw.db_url, "user", "carol", "max_lora_rank", None)
    u.post("load", {"name": path, "adapter_name": "c"})


def _trainer_adapters(gw, admin: str) -> set[str]:
    """The adapters the Trainer holds (the admin engine page: every replica's adapter table)."""
    r = gw.client.get("/api/v1/admin/engine", headers={"X-API-Key": admin})
    assert r.status_code == 200, r.text
    return {a["model_id"] for a in r.json()["models"][BASE]["trainer"]["adapters"]}


def test_finishing_a_session_releases_its_adapters(make_gateway):
    """finish_session gives back the training-client slots *and* unloads the adapters: four
    rounds of (new session, two models, finish) under a cap of 2 leave the Trainer holding at
    most 2 of this tenant's adapters, and a finished session's model answers 410. An adapter
    whose release failed (its session finished but the Trainer still holds it) is released by
    the background sweep."""
    from sqlmodel import Session

    from gateway.db import make_engine
    from gateway.db.tables import SessionRow, utcnow
    from tests.gateway.harness import fwdbwd, model, session

    gw = make_gateway(session_sweep_seconds=0.3)
    admin = gw.key("root", org="ops", scope="admin")
    key = gw.key("dave")
    set_quota(gw.db_url, "user", "dave", "max_training_clients", 2)
    c, h = gw.client, {"X-API-Key": key}
    last: list[str] = []
    for _ in range(4):
        sid = session(c, key)
        last = [model(c, key, sid, i) for i in range(2)]
        assert set(last) <= _trainer_adapters(gw, admin)
        r = c.post(f"/api/v1/sessions/{sid}/finish", json={}, headers=h)
        assert r.status_code == 200, r.text
        assert not set(last) & _trainer_adapters(gw, admin)
    r = fwdbwd(c, key, last[0], 1)
    assert r.status_code == 410 and "finished" in r.text, r.text
    # a finished session whose adapters are still loaded: the sweep releases them
    sid = session(c, key)
    mid = model(c, key, sid, 0)
    db = make_engine(gw.db_url)
    with Session(db) as s:
        row = s.get(SessionRow, sid)
        row.finished_at, row.finish_reason = utcnow(), "success"
        s.add(row)
        s.commit()
    db.dispose()
    deadline = time.monotonic() + 10
    while mid in _trainer_adapters(gw, admin) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert mid not in _trainer_adapters(gw, admin)


# -- Tinker checkpoints: ephemeral saves, copies, sampling sessions on others' checkpoints ------


def _tinker(make_gateway, **config):
    """(client sending alice's key, bob's key, the app env)."""
    gw = make_gateway(metadata_only_min_bytes=0, **config)
    gw.client.headers["X-API-Key"] = gw.key("alice")
    return gw.client, gw.key("bob"), gw


def _sample(client, sampler_id: str, headers: dict | None = None):
    """Submit one 2-token sample from a sampling session: the response (a future, or an error)."""
    body = {
        "sampling_session_id": sampler_id,
        "prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 2, 3]}]},
        "sampling_params": {"max_tokens": 2},
    }
    return client.post("/api/v1/asample", json=body, headers=headers or {})


def _db_rows(gw, table, *where):
    from sqlmodel import Session, select

    from gateway.db import make_engine

    db = make_engine(gw.db_url)
    try:
        with Session(db) as s:
            return list(s.exec(select(table).where(*where)).all())
    finally:
        db.dispose()


def test_ephemeral_sampler_saves_keep_only_the_newest(make_gateway):
    """Ephemeral save_weights_for_sampler (no name) are bounded per user by
    gateway.max_ephemeral_saves: a newer one deletes the oldest (files, row, its sampling
    session, which then answers 404); the newest keep sampling."""
    from gateway.db.tables import CheckpointRow
    from tests.gateway.harness import model, wait_future

    client, _, gw = _tinker(make_gateway, gateway={"max_ephemeral_saves": 3})
    mid = model(client, None)
    samplers = []
    for i in range(1, 7):
        body = {"model_id": mid, "seq_id": i, "sampling_session_seq_id": i}
        fut = client.post("/api/v1/save_weights_for_sampler", json=body)
        assert fut.status_code == 200, fut.text
        samplers.append(wait_future(client, None, fut.json())["sampling_session_id"])
    kept = _db_rows(gw, CheckpointRow, CheckpointRow.ephemeral == True)  # noqa: E712
    assert sorted(r.name for r in kept) == ["ephemeral-4", "ephemeral-5", "ephemeral-6"]
    on_disk = [p for p in (gw.data / "checkpoints").rglob("ephemeral-*") if p.is_dir()]
    assert len(on_disk) == 3, on_disk
    assert _sample(client, samplers[0]).status_code == 404
    fut = _sample(client, samplers[-1])
    assert fut.status_code == 200, fut.text
    assert wait_future(client, None, fut.json(), allow_metadata_only=False).status_code == 200


def test_copy_weights_is_a_metered_save_under_the_checkpoint_caps(make_gateway):
    """A copy takes a max_checkpoints slot and writes a ``checkpoint`` usage row like any save;
    a copy refused at the cap leaves no run or session behind."""
    from gateway.db.tables import SessionRow, TrainingRunRow, UsageBucketRow
    from tests.gateway.harness import model
    from tests.gateway.tinker_rest import save

    client, _, gw = _tinker(make_gateway)
    set_quota(gw.db_url, "user", "alice", "max_checkpoints", 2)
    path = save(client, model(client, None), 1, "save_weights", "src")
    r = client.post(
        "/api/v1/copy_weights", json={"source_path": path, "destination_project_id": "p"}
    )
    assert r.status_code == 200, r.text
    ledger = _db_rows(gw, UsageBucketRow, UsageBucketRow.kind == "checkpoint")
    assert sum(row.quantity for row in ledger) == 2  # the save and the copy
    runs, sessions = len(_db_rows(gw, TrainingRunRow)), len(_db_rows(gw, SessionRow))
    r = client.post(
        "/api/v1/copy_weights", json={"source_path": path, "destination_project_id": "p"}
    )
    assert r.status_code == 403 and "max_checkpoints" in r.text, r.text
    assert (len(_db_rows(gw, TrainingRunRow)), len(_db_rows(gw, SessionRow))) == (runs, sessions)


def test_sampling_session_on_a_published_checkpoint_stops_when_unpublished(make_gateway):
    """Bob's sampling session on alice's published checkpoint answers 404 (naming the session)
    once alice unpublishes it, and again once a TTL expires it after she republishes."""
    from tests.gateway.harness import model, session, wait_future
    from tests.gateway.tinker_rest import save

    client, bob, _ = _tinker(make_gateway)
    path = save(client, model(client, None), 1, "save_weights_for_sampler", "pub")
    ckpt_url = "/api/v1/training_runs/{}/checkpoints/{}".format(*path[9:].split("/", 1))
    assert client.post(f"{ckpt_url}/publish").status_code == 200
    as_bob = {"X-API-Key": bob}
    sid = session(client, bob)
    body = {"session_id": sid, "sampling_session_seq_id": 0, "model_path": path}
    r = client.post("/api/v1/create_sampling_session", json=body, headers=as_bob)
    assert r.status_code == 200, r.text
    sampler = r.json()["sampling_session_id"]
    fut = _sample(client, sampler, as_bob)
    assert fut.status_code == 200, fut.text
    assert wait_future(client, bob, fut.json(), allow_metadata_only=False).status_code == 200
    assert client.delete(f"{ckpt_url}/publish").status_code == 200
    r = _sample(client, sampler, as_bob)
    assert r.status_code == 404 and "sampling_session_id" in r.text, r.text
    # published again, then past its TTL
    assert client.post(f"{ckpt_url}/publish").status_code == 200
    assert _sample(client, sampler, as_bob).status_code == 200
    assert client.put(f"{ckpt_url}/ttl", json={"ttl_seconds": 1}).status_code == 200
    time.sleep(1.2)
    r = _sample(client, sampler, as_bob)
    assert r.status_code == 404 and "sampling_session_id" in r.text, r.text


# -- stored rows: custom losses, metadata, request traces --------------------------------------


def _loss_body(sid: str, seq: int) -> dict:
    """A valid traced loss (the sum of the logprobs) for create_custom_loss."""
    nodes = [
        {"op": "placeholder", "name": "logprobs", "target": "logprobs"},
        {"op": "call_function", "name": "s", "target": "torch.sum", "args": [{"ref": "logprobs"}]},
        {
            "op": "output",
            "name": "output",
            "target": "output",
            "args": [{"tuple": [{"ref": "s"}, {"dict": {}}]}],
        },
    ]
    return {
        "session_id": sid,
        "custom_loss_seq_id": seq,
        "name": "sum",
        "inputs": [{"name": "logprobs", "rank": 1}],
        "graph": {"format": 1, "nodes": nodes},
    }


def test_stored_rows_are_bounded_and_pruned(make_gateway):
    """Custom losses: at most gateway.max_custom_losses per user in live sessions (403), an
    ended session's deleted by the sweep; user_metadata over 16 KiB and too many tags are 400s
    naming the field; request traces past their retention or the per-user cap are deleted."""
    from gateway.db.tables import CustomLossRow, RequestTraceRow
    from tests.gateway.harness import fwdbwd, model, session, wait_future

    gw = make_gateway(
        session_sweep_seconds=0.3,
        gateway={"max_custom_losses": 2, "max_trace_rows_per_user": 3},
    )
    key = gw.key("erin")
    c, h = gw.client, {"X-API-Key": key}
    sid = session(c, key)
    for seq in range(2):
        r = c.post("/api/v1/create_custom_loss", json=_loss_body(sid, seq), headers=h)
        assert wait_future(c, key, r.json())["loss_id"], r.text
    r = c.post("/api/v1/create_custom_loss", json=_loss_body(sid, 2), headers=h)
    assert r.status_code == 403 and "max_custom_losses" in r.text, r.text
    # the session ends: its losses are deleted, and a new session has room again
    assert c.post(f"/api/v1/sessions/{sid}/finish", json={}, headers=h).status_code == 200
    deadline = time.monotonic() + 10
    while _db_rows(gw, CustomLossRow) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _db_rows(gw, CustomLossRow) == []
    sid = session(c, key)
    r = c.post("/api/v1/create_custom_loss", json=_loss_body(sid, 0), headers=h)
    assert r.status_code == 200, r.text
    # metadata and tags
    big = {"user_metadata": {"blob": "x" * 17000}}
    r = c.post("/api/v1/create_session", json=big, headers=h)
    assert r.status_code == 400 and "user_metadata" in r.text, r.text
    r = c.post("/api/v1/create_session", json={"tags": ["t"] * 33}, headers=h)
    assert r.status_code == 400 and "tags" in r.text, r.text
    body = {"session_id": sid, "model_seq_id": 0, "base_model": BASE, **big}
    r = c.post("/api/v1/create_model", json=body, headers=h)
    assert r.status_code == 400 and "user_metadata" in r.text, r.text
    # request traces: each finished training request of a session leaves a row; 3 are kept
    mid = model(c, key, sid, 1)
    for seq in range(1, 6):
        assert wait_future(c, key, fwdbwd(c, key, mid, seq).json()).status_code == 200
    deadline = time.monotonic() + 10
    while len(_db_rows(gw, RequestTraceRow)) != 3 and time.monotonic() < deadline:
        time.sleep(0.2)
    rows = _db_rows(gw, RequestTraceRow)
    assert len(rows) == 3, [(r.kind, r.target) for r in rows]
    assert {r.kind for r in rows} == {"forward_backward"}  # the newest kept


def test_live_sessions_and_sampling_sessions_are_capped(make_gateway):
    """A tenant looping on create_session (Tinker or native) stops at
    gateway.max_live_sessions_per_user live sessions (403 naming it) until one ends; a session's
    sampling sessions stop at gateway.max_sampling_sessions_per_session."""
    from tests.gateway.harness import session

    gw = make_gateway(
        gateway={"max_live_sessions_per_user": 3, "max_sampling_sessions_per_session": 2}
    )
    key = gw.key("erin")
    c, h = gw.client, {"X-API-Key": key}
    sids = [session(c, key) for _ in range(2)]
    r = c.post("/api/v1/twinkle/create_session", json={}, headers=h)
    assert r.status_code == 200, r.text  # the third live one: native counts too
    for route in ("/api/v1/create_session", "/api/v1/twinkle/create_session"):
        r = c.post(route, json={}, headers=h)
        assert r.status_code == 403, r.text
        assert r.json()["quota"]["name"] == "max_live_sessions_per_user", r.text
    assert c.post(f"/api/v1/sessions/{sids[0]}/finish", json={}, headers=h).status_code == 200
    assert c.post("/api/v1/create_session", json={}, headers=h).status_code == 200
    assert session(gw.client, gw.key("frank"))  # another user's sessions are their own

    def sampling(seq: int):
        body = {"session_id": sids[1], "sampling_session_seq_id": seq, "base_model": BASE}
        return c.post("/api/v1/create_sampling_session", json=body, headers=h)

    assert sampling(0).status_code == 200 and sampling(1).status_code == 200
    r = sampling(2)
    assert r.status_code == 403 and "max_sampling_sessions_per_session" in r.text, r.text
    assert sampling(0).status_code == 200  # an existing one is no new row
