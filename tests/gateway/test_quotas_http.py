"""Quotas through the real gateway (in-process engine on the mock backend, real SQLite, and a real
redis-server shared by two gateway apps standing in for two replicas): 50 concurrent create_model
calls against a cap of 3, a tokens-per-minute limit under 8 concurrent clients, 403 bodies that
name the quota, checkpoint caps, LoRA rank caps, and the replica/Redis config rule."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path

import pytest

from engine.errors import ConfigError
from gateway.config import ServerConfig, check_replicas_share_state
from tests.gateway.harness import (
    build_engines,
    create_model,
    fwdbwd,
    model,
    new_key,
    session,
    set_quota,
    sqlite_url,
    wait_future,
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """The engines' data dir, shared by the module's tests."""
    return Path(tmp_path_factory.mktemp("engine-data"))


@pytest.fixture
def replicas(make_gateway, each_kv, tmp_path, model_dir):
    """(db_url, [TestClient, ...]): one app in process, or two apps sharing one Redis. Engines
    are per test: the Trainer's scheduler belongs to the event loop of the app that drives it."""
    db_url = sqlite_url(tmp_path)
    n = 2 if each_kv == "redis" else 1
    gateway = {"num_replicas": 2} if n == 2 else {}
    engines = build_engines(model_dir, n, backend="mock")  # quotas: HTTP semantics only
    with ExitStack() as stack:
        gws = [
            stack.enter_context(
                make_gateway(
                    kv=each_kv,
                    data=tmp_path,
                    db_url=db_url,
                    engines=engines[i],
                    gateway=gateway,
                    flush_kv=i == 0,
                )
            )
            for i in range(n)
        ]
        yield db_url, [gw.client for gw in gws]


def test_fifty_concurrent_create_model_calls_against_a_cap_of_three(replicas) -> None:
    db_url, clients = replicas
    key = new_key(db_url, "alice")
    set_quota(db_url, "org", "acme", "max_training_clients", 3)
    sid = session(clients[0], key)
    with ThreadPoolExecutor(50) as pool:
        results = list(
            pool.map(lambda i: create_model(clients[i % len(clients)], key, sid, i), range(50))
        )
    ok = [(i, r) for i, r in enumerate(results) if r.status_code == 200]
    denied = [r for r in results if r.status_code != 200]
    assert len(ok) == 3, [r.text for _, r in ok]
    assert {r.status_code for r in denied} == {403}
    body = denied[0].json()
    assert body["error"]["code"] == "quota_exceeded"
    assert body["quota"] == {"name": "max_training_clients", "limit": 3, "current": 3}
    assert "max_training_clients" in body["detail"] and "limit 3" in body["detail"]
    assert denied[0].headers["x-should-retry"] == "false"
    for i, r in ok:  # the three that fit really were created (on the replica that took them)
        assert (
            wait_future(clients[i % len(clients)], key, r.json())["model_id"]
            == r.json()["model_id"]
        )
    # another organization is not affected; finishing the session frees the slots
    other = new_key(db_url, "zed", org="other")
    model(clients[-1], other, session(clients[-1], other))
    r = clients[0].post(f"/api/v1/sessions/{sid}/finish", json={}, headers={"X-API-Key": key})
    assert r.status_code == 200
    sid2 = session(clients[-1], key)
    assert [create_model(clients[-1], key, sid2, i).status_code for i in range(4)] == [
        200,
        200,
        200,
        403,
    ]


def test_tokens_per_minute_holds_within_5_percent_under_8_concurrent_clients(replicas) -> None:
    db_url, clients = replicas
    key = new_key(db_url, "alice")
    limit, chunk = 300, 10
    set_quota(db_url, "user", "alice", "train_tokens_per_minute", limit)  # a per-user override
    sid = session(clients[0], key)
    models = [model(clients[0], key, sid, i) for i in range(8)]

    last: dict[int, dict] = {}

    def client(i: int) -> tuple[int, list]:
        c, admitted, seq = clients[i % len(clients)], 0, 1
        while True:
            r = fwdbwd(c, key, models[i], seq, chunk)
            if r.status_code != 200:
                return admitted, [r]
            last[i] = r.json()
            admitted += chunk
            seq += 1

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(client, range(8)))
    total = sum(a for a, _ in results)
    assert 0.95 * limit <= total <= limit, total
    for _, (r,) in results:
        assert r.status_code == 429, r.text
        assert 1 <= int(r.headers["retry-after"]) <= 61
        assert "train_tokens_per_minute" in r.json()["detail"]
    # a request that can never fit is a hard error, failed in seq order (a 429 would be retried
    # by the SDK for minutes): the future carries the 403 message
    big = fwdbwd(clients[0], key, models[0], results[0][0] // chunk + 1, limit + 1)
    assert big.status_code == 200, big.text
    res = wait_future(clients[0], key, big.json())
    assert res["category"] == "user" and "train_tokens_per_minute" in res["error"]
    assert f"limit {limit}" in res["error"]
    for i, fut in last.items():  # drain the engine before teardown (futures run in order)
        wait_future(clients[i % len(clients)], key, fut)


def test_lora_rank_and_checkpoint_caps(replicas, tmp_path) -> None:
    db_url, clients = replicas
    c = clients[-1]
    key = new_key(db_url, "alice")
    set_quota(db_url, "org", "acme", "max_lora_rank", 8)
    set_quota(db_url, "user", "alice", "max_checkpoints", 1)
    sid = session(c, key)
    r = create_model(c, key, sid, 0, rank=16)
    assert r.status_code == 403
    assert r.json()["quota"] == {"name": "max_lora_rank", "limit": 8, "current": 16}
    mid = model(c, key, sid, 1, rank=8)
    h = {"X-API-Key": key}

    def save(seq: int, name: str) -> dict:
        r = c.post(
            "/api/v1/save_weights", headers=h, json={"model_id": mid, "seq_id": seq, "path": name}
        )
        assert r.status_code == 200, r.text
        return wait_future(c, key, r.json())

    assert save(1, "a")["path"].endswith("/weights/a")
    over = save(2, "b")  # the cap fails this seq_id in order, as a user error
    assert over["category"] == "user" and "max_checkpoints" in over["error"]
    assert "limit 1" in over["error"]
    r = c.post(
        "/api/v1/save_weights",
        headers=h,
        json={"model_id": mid, "seq_id": 3, "path": "a", "overwrite": True},
    )
    assert "path" in wait_future(c, key, r.json())  # overwriting a kept checkpoint fits its slot
    d = c.delete(f"/api/v1/training_runs/{mid}/checkpoints/weights/a", headers=h)
    assert d.status_code == 200, d.text
    assert save(4, "b")["path"].endswith("/weights/b")
    # a checkpoint that expires (TTL) gives its slot back too, whoever notices the expiry
    t = c.put(
        f"/api/v1/training_runs/{mid}/checkpoints/weights/b/ttl",
        headers=h,
        json={"ttl_seconds": 1},
    )
    assert t.status_code == 200, t.text
    assert "max_checkpoints" in save(5, "c")["error"]
    time.sleep(1.2)
    listed = c.get(f"/api/v1/training_runs/{mid}/checkpoints", headers=h).json()["checkpoints"]
    assert listed == []  # the listing purged the expired checkpoint
    # its quota release runs as a task on the app's loop right after deletion: polled (each try a
    # new seq_id; a denied one fails in order) rather than a fixed pause a loaded host may outrun
    seq, deadline = 6, time.monotonic() + 30
    got = save(seq, "c")
    while "max_checkpoints" in got.get("error", "") and time.monotonic() < deadline:
        time.sleep(0.1)
        seq += 1
        got = save(seq, "c")
    assert got.get("path", "").endswith("/weights/c"), got


def test_more_than_one_gateway_replica_needs_redis() -> None:
    two = ServerConfig.from_dict({"gateway": {"num_replicas": 2}})
    with pytest.raises(ConfigError) as ei:
        check_replicas_share_state(None, two)
    assert "redis_url" in str(ei.value) and "TWINKLE_REDIS_URL" in str(ei.value)
    ok = ServerConfig.from_dict({"gateway": {"num_replicas": 2, "redis_url": "redis://h:6379/0"}})
    assert ok.gateway.num_replicas == 2
    check_replicas_share_state(None, ok)
    check_replicas_share_state("redis://h:6379/0", two)  # TWINKLE_REDIS_URL counts too


def test_sample_token_rate_covers_tinker_and_openai_sampling(replicas) -> None:
    db_url, clients = replicas
    c = clients[0]
    key = new_key(db_url, "alice")
    set_quota(db_url, "user", "alice", "sample_tokens_per_minute", 40)
    h = {"X-API-Key": key}
    body = {
        "base_model": "twinkle/tiny-chat",
        "num_samples": 1,
        "prompt": {"chunks": [{"type": "encoded_text", "tokens": [5, 6, 7, 8]}]},
        "sampling_params": {"max_tokens": 6, "temperature": 0},
    }
    r = c.post("/api/v1/asample", headers=h, json=body)  # charges 4 + 6, refunds the unused
    assert r.status_code == 200, r.text
    wait_future(c, key, r.json())
    statuses = []
    for _ in range(12):
        r = c.post(
            "/v1/completions",
            headers=h,
            json={"model": "twinkle/tiny-chat", "prompt": [5, 6, 7, 8], "max_tokens": 6},
        )
        statuses.append(r.status_code)
        if r.status_code == 429:
            break
    assert statuses[0] == 200 and statuses[-1] == 429, statuses
    assert "sample_tokens_per_minute" in r.json()["detail"] and int(r.headers["retry-after"]) >= 1
    r = c.post("/api/v1/asample", headers=h, json=body)
    assert r.status_code == 429
    # larger than the limit itself: 403, never retried
    big = {**body, "sampling_params": {"max_tokens": 100}}
    r = c.post("/api/v1/asample", headers=h, json=big)
    assert r.status_code == 403 and r.json()["quota"]["name"] == "sample_tokens_per_minute"
