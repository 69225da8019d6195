"""The per-user concurrent-sampling limit on the OpenAI-compatible API and the Tinker asample
route (real in-process engine behind a gate, real SQLite)."""

from __future__ import annotations

import asyncio
import threading
import time

import openai
import pytest

from gateway.context import services_of
from gateway.db import make_engine, upgrade_to_head
from gateway.errors import RateLimitedError
from gateway.quotas.concurrency import SamplingLimiter
from tests.gateway.harness import BASE, wait_future
from tests.gateway.openai_helpers import MESSAGES, oai, openai_env


@pytest.fixture(scope="module")
def env(make_gateway):
    return openai_env(make_gateway, limited=True)


def test_limiter_unit(tmp_path):
    """The limiter on the quota service (in-process store): per user, idempotent release."""
    from gateway.accounts.keys import Principal
    from gateway.quotas import MemoryQuotaStore, Quotas

    url = f"sqlite:///{tmp_path / 'lim.db'}"
    upgrade_to_head(url)
    db = make_engine(url)
    quotas = Quotas(MemoryQuotaStore(), db, default_user_quotas={"max_concurrent_samples": 2})
    lim = SamplingLimiter(quotas)
    u1 = Principal(user_id=1, user_name="u1", scope="user", key_id=1)
    u2 = Principal(user_id=2, user_name="u2", scope="user", key_id=2)

    async def main():
        a, b = await lim.acquire(u1), await lim.acquire(u1)
        with pytest.raises(RateLimitedError) as ei:
            await lim.acquire(u1)
        assert ei.value.headers()["retry-after"] == "1"
        other = await lim.acquire(u2)  # per user
        await a.release()
        await a.release()  # idempotent
        assert len(await quotas.store.gauge("user:1:samples")) == 1
        async with lim.acquire(u1):
            assert len(await quotas.store.gauge("user:1:samples")) == 2
        await b.release()
        await other.release()
        assert (
            len(await quotas.store.gauge("user:1:samples")) == 0
            and len(await quotas.store.gauge("user:2:samples")) == 0
        )
        unlimited = SamplingLimiter(Quotas(MemoryQuotaStore(), db, default_user_quotas={}))
        assert len([await unlimited.acquire(u1) for _ in range(100)]) == 100

    asyncio.run(main())
    db.dispose()


def _held(quotas, user_id: int) -> int:
    """Sampling slots a user holds in the (in-process) quota store."""
    return len(asyncio.run(quotas.store.gauge(f"user:{user_id}:samples")))


def _limited_headers(env, user="alice") -> dict:
    return {"Authorization": f"Bearer {env.keys[user]}"}


def test_overlapping_requests_over_the_limit_get_429(env):
    eng, client = env.limited_engine, env.limited
    eng.gate.clear()
    eng.entered = threading.Semaphore(0)
    first: dict = {}

    def slow():
        first["r"] = client.post(
            "/v1/chat/completions",
            headers=_limited_headers(env),
            json={"model": BASE, "messages": MESSAGES, "max_tokens": 4, "temperature": 0},
        )

    t = threading.Thread(target=slow)
    t.start()
    try:
        assert eng.entered.acquire(timeout=30)  # the first request is inside the engine call
        r = client.post(
            "/v1/chat/completions",
            headers=_limited_headers(env),
            json={"model": BASE, "messages": MESSAGES, "max_tokens": 4},
        )
        assert r.status_code == 429, r.text
        assert r.headers["retry-after"] == "1"
        assert r.json()["error"]["code"] == "rate_limited"
        # the openai client sees a RateLimitError
        with pytest.raises(openai.RateLimitError):
            oai(env, client=client).completions.create(model=BASE, prompt="hi", max_tokens=2)
        # the Tinker asample route shares the limit
        r = client.post(
            "/api/v1/asample",
            headers=_limited_headers(env),
            json={
                "base_model": BASE,
                "num_samples": 1,
                "prompt": {"chunks": [{"type": "encoded_text", "tokens": [5, 6, 7]}]},
                "sampling_params": {"max_tokens": 2, "temperature": 0},
            },
        )
        assert r.status_code == 429 and r.headers["retry-after"] == "1"
        # another user is not limited by alice's requests
        eng.gate.set()
        r = client.post(
            "/v1/completions",
            headers=_limited_headers(env, "bob"),
            json={"model": BASE, "prompt": "hi", "max_tokens": 2},
        )
        assert r.status_code == 200, r.text
    finally:
        eng.gate.set()
        t.join(30)
    assert first["r"].status_code == 200, first["r"].text
    assert _held(services_of(env.limited_app).quotas, env.uids["alice"]) == 0
    r = client.post(
        "/v1/chat/completions",
        headers=_limited_headers(env),
        json={"model": BASE, "messages": MESSAGES, "max_tokens": 2},
    )
    assert r.status_code == 200, r.text


def test_asample_holds_its_slot_until_the_future_finishes(env):
    eng, client = env.limited_engine, env.limited
    eng.gate.clear()
    eng.entered = threading.Semaphore(0)
    h = {"X-API-Key": env.keys["alice"]}
    body = {
        "base_model": BASE,
        "num_samples": 1,
        "prompt": {"chunks": [{"type": "encoded_text", "tokens": [5, 6, 7]}]},
        "sampling_params": {"max_tokens": 2, "temperature": 0},
    }
    try:
        fut = client.post("/api/v1/asample", headers=h, json=body)
        assert fut.status_code == 200, fut.text
        assert eng.entered.acquire(timeout=30)
        quotas = services_of(env.limited_app).quotas
        assert _held(quotas, env.uids["alice"]) == 1
        r = client.post("/v1/completions", headers=h, json={"model": BASE, "prompt": "hi"})
        assert r.status_code == 429
        eng.gate.set()
        res = wait_future(client, env.keys["alice"], fut.json())
        assert not isinstance(res, dict), res  # the protobuf payload
    finally:
        eng.gate.set()
    deadline = time.monotonic() + 10
    while _held(quotas, env.uids["alice"]) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _held(quotas, env.uids["alice"]) == 0
