"""Helpers for the OpenAI-compatible API tests (tests/gateway/test_openai_*.py): the app (real
Trainer / Sampler on the tiny model, real SQLite), an optional second app on the same engines with a
per-user concurrent-sampling limit of 1 and a gate on its engine calls, and the official client."""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

import openai
from fastapi.testclient import TestClient
from sqlmodel import Session, select

from gateway.db import make_engine
from gateway.db.tables import UserRow
from gateway.engine_client import EngineClient
from tests.gateway.harness import BASE, wait_future

MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Tell me about the cat."},
]


class _GatedSampler:
    """The real Sampler, whose ``sample`` and ``sample_stream`` wait for ``owner.gate`` (and
    release ``owner.entered`` when they arrive); every other method is the Sampler's own."""

    def __init__(self, sampler, owner: GatedEngineClient) -> None:
        self._sampler, self._owner = sampler, owner

    def __getattr__(self, name: str):
        return getattr(self._sampler, name)

    async def _wait(self) -> None:
        self._owner.entered.release()
        await asyncio.to_thread(self._owner.gate.wait, 30)

    async def sample(self, inp):
        await self._wait()
        return await self._sampler.sample(inp)

    async def sample_stream(self, inp):
        await self._wait()
        async for item in self._sampler.sample_stream(inp):
            yield item


class GatedEngineClient(EngineClient):
    """An in-process engine client whose sampling calls wait until the test opens the gate."""

    def __init__(self, engines: dict) -> None:
        gated = {
            base: {**roles, "sampler": _GatedSampler(roles["sampler"], self)}
            for base, roles in engines.items()
        }
        super().__init__(gated, ray_handles=False)
        self.gate = threading.Event()
        self.entered = threading.Semaphore(0)


def openai_env(make_gateway, limited: bool = False) -> SimpleNamespace:
    """``client`` (the app), ``keys`` and ``uids`` of alice and bob, the engine ``sampler``; with
    ``limited``: ``limited`` (a client of the second app), ``limited_app``, ``limited_engine``."""
    gw = make_gateway()
    keys = {name: gw.key(name) for name in ("alice", "bob")}
    db = make_engine(gw.db_url)
    with Session(db) as s:
        uids = {u.name: u.id for u in s.exec(select(UserRow)).all()}
    db.dispose()
    env = SimpleNamespace(
        client=gw.client, keys=keys, uids=uids, sampler=gw.engines[BASE]["sampler"]
    )
    if limited:
        env.limited_engine = GatedEngineClient(gw.engines)
        lim = make_gateway(
            data=gw.data,
            db_url=gw.db_url,
            engines=gw.engines,
            engine_client=env.limited_engine,
            max_concurrent_samples_per_user=1,
        )
        env.limited, env.limited_app = lim.client, lim.app
    return env


def oai(env, user: str = "alice", client: TestClient | None = None) -> openai.OpenAI:
    """The official client, sending its requests through the in-process app."""
    return openai.OpenAI(
        base_url="http://testserver/v1",
        api_key=env.keys[user],
        http_client=client or env.client,
        max_retries=0,
    )


def direct(env, coro_fn, *args):
    """Call an engine Sampler method directly (outside the app)."""
    return asyncio.run(getattr(env.sampler, coro_fn)(*args))


def bobs_checkpoint_path(env) -> str:
    """A sampler checkpoint saved by bob through the Tinker API (an untrained LoRA)."""
    c, key = env.client, env.keys["bob"]
    h = {"X-API-Key": key}
    sid = c.post("/api/v1/create_session", json={}, headers=h).json()["session_id"]
    fut = c.post(
        "/api/v1/create_model",
        headers=h,
        json={"session_id": sid, "model_seq_id": 0, "base_model": BASE, "lora_config": {"rank": 4}},
    )
    assert fut.status_code == 200, fut.text
    model_id = wait_future(c, key, fut.json())["model_id"]
    fut = c.post(
        "/api/v1/save_weights_for_sampler",
        headers=h,
        json={"model_id": model_id, "seq_id": 1, "path": "bobs"},
    )
    path = wait_future(c, key, fut.json())["path"]
    assert path == f"tinker://{model_id}/sampler_weights/bobs"
    return path
