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
