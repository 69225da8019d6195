"""Quota paths through every dialect, fuzzed against a real `twinkle serve` (the pool's ``hosted``
profile): a user capped at 2 training clients and 2 checkpoints sends a seeded random sequence of
every request that creates an adapter or a checkpoint, in the Tinker REST dialect (create_model,
save_state, save_weights_for_sampler, copy_weights, finishing a session) and the native one
(add_adapter_to_model, load and resume_from_checkpoint into new adapter names, save). After every
request, what the server really holds is counted (the Trainer's adapters of that user, from the
admin engine page; the user's checkpoints) and must stay within the caps, whatever the quota
store's own counters say; a refusal is a 403 naming the quota, never a 5xx.

``TWINKLE_FUZZ_SEED`` / ``TWINKLE_FUZZ_COUNT`` as in tests/e2e/test_fuzz_api.py (the count here is
a third of it: each request trains or saves for real).
"""

from __future__ import annotations

import json
import os
import random
import time
from dataclasses import dataclass, field

import httpx
import pytest

from tests.e2e.hosted_profile import set_quotas
from tests.gateway.harness import create_model, session, wait_future

pytestmark = pytest.mark.e2e
BASE = "twinkle/tiny-chat"
NATIVE = f"/api/v1/model/{BASE}/twinkle"
SEED = int(os.environ.get("TWINKLE_FUZZ_SEED", "20261205"))
COUNT = max(12, int(os.environ.get("TWINKLE_FUZZ_COUNT", "120")) // 3)
CAPS = {"max_training_clients": 2, "max_checkpoints": 2}
LORA4 = json.dumps({"_TWINKLE_TYPE_": "LoraConfig", "r": 4, "target_modules": "all-linear"})


@dataclass
class Tenant:
    http: httpx.Client
    key: str
    tinker: dict[str, list[str]] = field(default_factory=dict)  # session -> model ids
    seq: dict[str, int] = field(default_factory=dict)  # model id -> next seq_id
    native: dict[str, list[str]] = field(default_factory=dict)  # session -> adapter names
    paths: list[str] = field(default_factory=list)  # checkpoint paths saved so far

    def settle(self, r: httpx.Response) -> httpx.Response | dict:
        """A Tinker future's result (dict), or the refusal itself."""
        if r.status_code != 200 or "request_id" not in r.json():
            return r
        return wait_future(self.http, self.key, r.json(), allow_metadata_only=False)


def _refused_rightly(what: str, out: httpx.Response | dict) -> None:
    if isinstance(out, dict):
        err = out.get("error") or ""
        if "quota" in str(out.get("category", "")) or "max_" in str(err):
            assert any(q in str(err) for q in CAPS), (what, out)
        return
    assert out.status_code < 500, (what, out.status_code, out.text)
    if out.status_code == 403:
        assert any(q in out.text for q in CAPS), (what, out.text)


def _tinker_op(t: Tenant, rng: random.Random) -> tuple[str, httpx.Response | dict]:
    models = [m for ms in t.tinker.values() for m in ms]
    choice = rng.choice(["create_model", "save_state", "sampler", "copy", "finish"])
    if choice == "create_model" or not models:
        sid = rng.choice([*t.tinker, None]) if t.tinker else None
        if sid is None:
            sid = session(t.http, t.key)
            t.tinker[sid] = []
        out = t.settle(create_model(t.http, t.key, sid, len(t.tinker[sid])))
        if isinstance(out, dict) and out.get("model_id"):
            t.tinker[sid].append(out["model_id"])
            t.seq[out["model_id"]] = 1
        return "tinker create_model", out
    mid = rng.choice(models)
    if choice == "finish":
        sid = next(s for s, ms in t.tinker.items() if mid in ms)
        r = t.http.post(f"/api/v1/sessions/{sid}/finish", json={}, headers={"X-API-Key": t.key})
        del t.tinker[sid]
        return "tinker finish", r
    if choice == "copy" and t.paths:
        body = {"source_path": rng.choice(t.paths), "destination_project_id": "fuzz"}
        out = t.settle(t.http.post("/api/v1/copy_weights", json=body, headers=_h(t)))
        return "tinker copy_weights", out
    route = "save_weights_for_sampler" if choice == "sampler" else "save_weights"
    body = {"model_id": mid, "seq_id": t.seq[mid], "path": f"c{rng.randrange(4)}"}
    t.seq[mid] += 1
    out = t.settle(t.http.post(f"/api/v1/{route}", json=body, headers=_h(t)))
    if isinstance(out, dict) and "path" in out:
        t.paths.append(out["path"])
    return f"tinker {route}", out


def _h(t: Tenant, sid: str | None = None) -> dict:
    h = {"X-API-Key": t.key}
    return {**h, "X-Twinkle-Session-Id": sid} if sid else h


def _native_op(t: Tenant, rng: random.Random) -> tuple[str, httpx.Response]:
    if not t.native or rng.random() < 0.2:
        r = t.http.post("/api/v1/twinkle/create_session", json={}, headers=_h(t))
        assert r.status_code == 200, r.text
        sid = r.json()["session_id"]
        t.native[sid] = []
        t.http.post(f"{NATIVE}/create", json={}, headers=_h(t, sid))
    sid = rng.choice(list(t.native))
    name = f"a{rng.randrange(100)}"
    choice = rng.choice(["add_adapter_to_model", "load", "resume_from_checkpoint", "save"])
    if choice == "save" and t.native[sid]:
        body = {"name": f"n{rng.randrange(4)}", "adapter_name": rng.choice(t.native[sid])}
        r = t.http.post(f"{NATIVE}/save", json=body, headers=_h(t, sid))
        if r.status_code == 200:
            t.paths.append(r.json()["twinkle_path"])
        return "native save", r
    if choice in ("load", "resume_from_checkpoint") and t.paths:
        body = {"name": rng.choice(t.paths), "adapter_name": name}
    else:
        choice, body = "add_adapter_to_model", {"adapter_name": name, "config": LORA4}
    r = t.http.post(f"{NATIVE}/{choice}", json=body, headers=_h(t, sid))
    if r.status_code == 200:
        t.native[sid].append(name)
    return f"native {choice}", r


def _held(http: httpx.Client, admin: str, user_id: int, key: str) -> tuple[int, int]:
    """(the Trainer's adapters of the user, the user's checkpoints)."""
    r = http.get("/api/v1/admin/engine", headers={"X-API-Key": admin})
    adapters = r.json()["models"][BASE]["trainer"]["adapters"]
    mine = [a for a in adapters if str(a["tenant"]) == str(user_id)]
    ckpts = http.get("/api/v1/checkpoints", params={"limit": 1000}, headers={"X-API-Key": key})
    assert ckpts.status_code == 200, ckpts.text
    return len(mine), len(ckpts.json()["checkpoints"])


def test_every_dialects_quota_paths_hold_the_caps(pool, start_hosted) -> None:
    srv = pool.get("hosted", start_hosted)
    key, admin = srv.create_key("fuzz-quota-paths"), srv.create_key("fuzz-quota-admin", admin=True)
    set_quotas(srv, "fuzz-quota-paths", **CAPS)
    rng = random.Random(SEED)
    seen: dict[str, dict[int, int]] = {}
    with httpx.Client(base_url=srv.url, timeout=60) as http:
        users = http.get("/api/v1/admin/users", headers={"X-API-Key": admin}).json()["users"]
        uid = next(u["id"] for u in users if u["name"] == "fuzz-quota-paths")
        t = Tenant(http, key)
        for i in range(COUNT):
            # Tinker alone first: a native session has no finish, so once native adapters hold
            # the slots only checkpoints and refusals remain to try
            native = i >= COUNT // 2 and rng.random() < 0.5
            what, out = (_native_op if native else _tinker_op)(t, rng)
            _refused_rightly(what, out)
            code = out.status_code if isinstance(out, httpx.Response) else 200
            seen.setdefault(what, {}).setdefault(code, 0)
            seen[what][code] += 1
            deadline = time.monotonic() + 10  # a finish unloads before it answers; slack for Ray
            while (held := _held(http, admin, uid, key))[0] > CAPS["max_training_clients"]:
                assert time.monotonic() < deadline, (what, held)
                time.sleep(0.5)
            assert held[1] <= CAPS["max_checkpoints"], (what, held)
    print(f"quota paths: {seen}")
    assert sum(c.get(403, 0) for c in seen.values()) > 0  # the caps were reached
