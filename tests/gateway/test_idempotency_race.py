"""Concurrent retries of one request run once: 20 identical submits sent at once give one future,
one engine execution and one quota charge; the same key with another body is a 409.

Three layers, each over the in-process KV and a real Redis:

* the Tinker routes (real gateway, in-process Trainer and Sampler on the tiny model, real SQLite):
  sequenced forward_backward (`gateway.tinker_api.sequenced.submit_sequenced`) and asample with a
  seq_id (`submit_once`). The quota store is
  slowed by 50 ms per charge so the window between claim and submit is wide (before the claim
  existed, every one of the 20 copies charged and submitted in that window);
* the future store's claim across two replicas (two `FutureStore`s on one shared KV);
* the `X-Idempotency-Key` middleware across two replicas (two middlewares on one shared KV).
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
from fastapi.testclient import TestClient
from tinker import types
from tinker.proto.request_conv import forward_backward_request_to_proto

from gateway.accounts.keys import authenticate_engine
from gateway.context import services_of
from gateway.futures.kv import KV, MemoryKV, RedisKV
from gateway.futures.store import Claim, FutureRecord, FutureStore
from gateway.middleware import IdempotencyKeyMiddleware, RequestHeadersMiddleware
from tests.gateway.harness import BASE, build_engines, make_app, new_key, set_quota

N = 20
TOKENS = (1, 2, 3)


@pytest.fixture(params=["memory", "redis"])
def kv_kind(request) -> str | None:
    """None (in-process stores), or the URL of a flushed real Redis."""
    if request.param == "memory":
        return None
    url = request.getfixturevalue("redis_url")
    import redis

    redis.Redis.from_url(url).flushdb()
    return url


def fb_body(model_id: str, seq_id: int, tokens: tuple[int, ...]) -> bytes:
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(list(tokens)),
        loss_fn_inputs={"target_tokens": [t + 1 for t in tokens], "weights": [1.0] * len(tokens)},
    )
    req = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=[datum], loss_fn="cross_entropy"),
        model_id=model_id,
        seq_id=seq_id,
    )
    return forward_backward_request_to_proto(req).SerializeToString()


def _make_kv(url: str | None) -> KV:
    return MemoryKV() if url is None else RedisKV(url)


# -- the Tinker routes ---------------------------------------------------------------------------


@pytest.fixture
def gateway(tmp_path, kv_kind):
    db_url = f"sqlite:///{tmp_path / 'twinkle.db'}"
    (engines,) = build_engines(tmp_path, 1)
    app = make_app(tmp_path, db_url, engines, gateway={"redis_url": kv_kind} if kv_kind else {})
    key = new_key(db_url, "alice")
    for quota in ("train_tokens_per_minute", "sample_tokens_per_minute"):
        set_quota(db_url, "user", "alice", quota, 1_000_000)  # metered, never reached
    with TestClient(app) as client:
        client.headers["X-API-Key"] = key
        yield client, app, engines[BASE], key


def _wait(client: TestClient, request_id: str) -> dict | bytes:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        r = client.post("/api/v1/retrieve_future", json={"request_id": request_id})
        assert r.status_code == 200, r.text
        if r.headers["content-type"].startswith("application/x-protobuf"):
            return r.content
        if r.json().get("type") != "try_again":
            return r.json()
    raise AssertionError("future did not finish")


def _slow_and_count(app, trainer) -> tuple[list, list]:
    """Slow every quota charge by 50 ms (a wide race window) and count charges and Trainer
    forward_backward calls."""
    charges: list[int] = []
    calls: list[int] = []
    store = services_of(app).quotas.store
    charge, fb = store.charge, trainer.forward_backward

    async def slow_charge(checks, amount):
        await asyncio.sleep(0.05)
        charges.append(amount)
        return await charge(checks, amount)

    async def counted_fb(model_id, *, seq_id, inp):
        calls.append(seq_id)
        return await fb(model_id, seq_id, inp)

    store.charge = slow_charge
    trainer.forward_backward = counted_fb
    return charges, calls


async def _burst(app, key: str, bodies: list[bytes], route: str = "forward_backward"):
    """POST every body to ``route`` at once (one event loop: the app's)."""
    transport = httpx.ASGITransport(app=app)
    ctype = "application/x-protobuf" if route == "forward_backward" else "application/json"
    headers = {"X-API-Key": key, "Content-Type": ctype}
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as ac:
        return await asyncio.gather(
            *(ac.post(f"/api/v1/{route}", content=b, headers=headers) for b in bodies)
        )


async def _train_tokens_used(app, key: str) -> int:
    who = authenticate_engine(services_of(app).db_engine, key)
    from sqlmodel import Session

    with Session(services_of(app).db_engine) as db:
        usage = await services_of(app).quotas.usage(who, db)
    return usage["user"]["train_tokens_per_minute"]["current"]


def test_twenty_identical_forward_backwards_run_once(gateway) -> None:
    client, app, engines, key = gateway
    trainer = engines["trainer"]
    sid = client.post("/api/v1/create_session", json={}).json()["session_id"]
    fut = client.post(
        "/api/v1/create_model",
        json={"session_id": sid, "model_seq_id": 0, "base_model": BASE, "lora_config": {"rank": 4}},
    ).json()
    _wait(client, fut["request_id"])
    model_id = fut["model_id"]
    charges, calls = _slow_and_count(app, trainer)
    used_before = client.portal.call(_train_tokens_used, app, key)

    body = fb_body(model_id, 1, TOKENS)
    replies = client.portal.call(_burst, app, key, [body] * N)

    assert [r.status_code for r in replies] == [200] * N, [r.text for r in replies]
    ids = {r.json()["request_id"] for r in replies}
    assert len(ids) == 1, ids
    assert isinstance(_wait(client, ids.pop()), bytes)  # the ForwardBackwardOutput
    assert calls == [1]
    assert charges == [len(TOKENS)]
    used = client.portal.call(_train_tokens_used, app, key) - used_before
    assert used == len(TOKENS)

    # The same (model_id, seq_id) with another body: 409, nothing charged or run.
    other = client.post(
        "/api/v1/forward_backward",
        content=fb_body(model_id, 1, (4, 5)),
        headers={"Content-Type": "application/x-protobuf"},
    )
    assert other.status_code == 409, other.text
    assert "seq_id" in other.json()["detail"]

    # Two different bodies racing for seq_id 2: one wins (one future, one run), the other 409s.
    replies = client.portal.call(
        _burst, app, key, [fb_body(model_id, 2, TOKENS), fb_body(model_id, 2, (7, 8))] * (N // 2)
    )
    ok = [r for r in replies if r.status_code == 200]
    assert {r.status_code for r in replies} == {200, 409}
    assert len({r.json()["request_id"] for r in ok}) == 1
    _wait(client, ok[0].json()["request_id"])
    assert calls == [1, 2]
    assert len(charges) == 2


def test_twenty_identical_samples_run_once(gateway) -> None:
    client, app, engines, key = gateway
    sid = client.post("/api/v1/create_session", json={}).json()["session_id"]
    sampler_id = client.post(
        "/api/v1/create_sampling_session",
        json={"session_id": sid, "sampling_session_seq_id": 0, "base_model": BASE},
    ).json()["sampling_session_id"]
    charges, _ = _slow_and_count(app, engines["trainer"])
    sampler, calls = engines["sampler"], []
    sample = sampler.sample

    async def counted_sample(inp, *args, **kw):
        calls.append(inp.num_samples)
        return await sample(inp, *args, **kw)

    sampler.sample = counted_sample
    req = {
        "sampling_session_id": sampler_id,
        "seq_id": 1,
        "num_samples": 2,
        "prompt": {"chunks": [{"type": "encoded_text", "tokens": list(TOKENS)}]},
        "sampling_params": {"max_tokens": 4, "seed": 0},
    }
    replies = client.portal.call(_burst, app, key, [json.dumps(req).encode()] * N, "asample")

    assert [r.status_code for r in replies] == [200] * N, [r.text for r in replies]
    answers = {json.dumps(r.json(), sort_keys=True) for r in replies}
    assert len(answers) == 1, answers  # one request id, the same sample_sequence_ids
    assert isinstance(_wait(client, replies[0].json()["request_id"]), bytes)
    assert calls == [2]
    assert charges == [len(TOKENS) + 4 * 2]  # prompt + max_tokens per sample, charged once
    req["sampling_params"]["seed"] = 1
    other = client.post("/api/v1/asample", json=req)
    assert other.status_code == 409, other.text


# -- the future store's claim across replicas ---------------------------------------------------


def test_claim_is_atomic_across_replicas(kv_kind) -> None:
    async def main() -> tuple[set[str], int]:
        kv = _make_kv(kv_kind)
        stores = [FutureStore(kv, shared=True), FutureStore(kv, shared=True)]
        runs = 0

        async def run() -> tuple[str, object]:
            nonlocal runs
            runs += 1
            return "json", {"ok": True}

        async def submit(i: int) -> str:
            store = stores[i % 2]
            got = await store.claim(("m", 1), "fp")
            if isinstance(got, FutureRecord):
                return got.request_id
            assert isinstance(got, Claim)
            await asyncio.sleep(0.05)  # the quota charge between claim and submit
            return (await store.submit(user_id=1, kind="t", run=run, claim=got)).request_id

        ids = await asyncio.gather(*(submit(i) for i in range(N)))
        with pytest.raises(Exception, match="seq_id: 1 of m"):
            await stores[1].claim(("m", 1), "another fp")
        # A released claim (e.g. a 429 before submit) lets the next copy claim again.
        first = await stores[0].claim(("m", 2), "fp")
        assert isinstance(first, Claim)
        waiter = asyncio.ensure_future(stores[1].claim(("m", 2), "fp"))
        await asyncio.sleep(0.1)
        assert not waiter.done()  # waits for the first copy rather than racing it
        await stores[0].release(first)
        assert isinstance(await asyncio.wait_for(waiter, 5), Claim)
        for s in stores:
            await asyncio.gather(*s._tasks)
        await stores[0].aclose()
        return set(ids), runs

    ids, runs = asyncio.run(main())
    assert len(ids) == 1 and runs == 1


# -- X-Idempotency-Key across replicas -----------------------------------------------------------


def test_idempotency_key_runs_once_across_replicas(kv_kind) -> None:
    async def main() -> None:
        kv = _make_kv(kv_kind)
        runs = 0

        async def app(scope, receive, send) -> None:  # a slow POST handler that counts its runs
            nonlocal runs
            while (await receive()).get("more_body"):
                pass
            runs += 1
            await asyncio.sleep(0.1)
            body = json.dumps({"run": runs}).encode()
            await send(
                {
                    "type": "http.response.start",
                    "status": 200,
                    "headers": [(b"content-type", b"application/json")],
                }
            )
            await send({"type": "http.response.body", "body": body})

        replicas = [
            RequestHeadersMiddleware(IdempotencyKeyMiddleware(app, kv_getter=lambda: kv))
            for _ in range(2)
        ]
        clients = [
            httpx.AsyncClient(transport=httpx.ASGITransport(app=r), base_url="http://t")
            for r in replicas
        ]
        headers = {"X-API-Key": "k", "X-Idempotency-Key": "abc"}
        replies = await asyncio.gather(
            *(
                clients[i % 2].post("/api/v1/copy_weights", json={"a": 1}, headers=headers)
                for i in range(N)
            )
        )
        assert runs == 1
        assert [r.status_code for r in replies] == [200] * N
        assert {r.json()["run"] for r in replies} == {1}
        assert sum(r.headers.get("x-idempotent-replay") == "true" for r in replies) == N - 1
        conflict = await clients[1].post("/api/v1/copy_weights", json={"a": 2}, headers=headers)
        assert conflict.status_code == 409
        for c in clients:
            await c.aclose()
        await kv.aclose()

    asyncio.run(main())
