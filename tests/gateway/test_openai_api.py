"""The OpenAI-compatible API with an in-process engine (real Trainer / Sampler on the tiny model,
real SQLite), driven by the official `openai` package: models, chat and text completions (whole
and streamed), stop strings, usage, logprobs, errors, ownership of checkpoints, and the per-user
concurrent-sampling limit (also on the Tinker asample route)."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import openai
import pytest
from fastapi.testclient import TestClient
from sqlmodel import Session, select

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from engine.protocol import SampleInput, SamplingParams  # noqa: E402
from engine.sampler import Sampler  # noqa: E402
from engine.trainer import Trainer  # noqa: E402
from gateway.accounts.service import create_user_and_key  # noqa: E402
from gateway.config import ServerConfig  # noqa: E402
from gateway.db import make_engine, session_scope, upgrade_to_head  # noqa: E402
from gateway.db.tables import UserRow  # noqa: E402
from gateway.engine_client import EngineClient  # noqa: E402
from gateway.errors import RateLimitedError  # noqa: E402
from gateway.main import create_app  # noqa: E402
from gateway.openai_api import responses  # noqa: E402
from gateway.quotas.concurrency import SamplingLimiter  # noqa: E402
from gateway.settings import Settings  # noqa: E402

BASE = "twinkle/tiny-chat"
MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Tell me about the cat."},
]


class GatedEngineClient(EngineClient):
    """An in-process engine client whose `sample` calls wait until the test opens the gate."""

    def __init__(self, engines: dict) -> None:
        super().__init__(engines, ray_handles=False)
        self.gate = threading.Event()
        self.entered = threading.Semaphore(0)

    async def sampler(self, base_model: str, method: str, *args, affinity=None):
        if method == "sample":
            self.entered.release()
            await asyncio.to_thread(self.gate.wait, 30)
        return await super().sampler(base_model, method, *args, affinity=affinity)

    async def sampler_stream(self, base_model: str, method: str, *args, affinity=None):
        self.entered.release()
        await asyncio.to_thread(self.gate.wait, 30)
        async for item in super().sampler_stream(base_model, method, *args, affinity=affinity):
            yield item


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    data = Path(tmp_path_factory.mktemp("data"))
    settings = Settings(data_dir=data, database_url=f"sqlite:///{data}/twinkle.db")
    upgrade_to_head(settings.database_url)
    db = make_engine(settings.database_url)
    with session_scope(db) as s:
        keys = {
            name: create_user_and_key(s, user_name=name, admin=False) for name in ("alice", "bob")
        }
    with Session(db) as s:
        uids = {u.name: u.id for u in s.exec(select(UserRow)).all()}
    config = ServerConfig(long_poll_seconds=0.5)
    m = config.models[0]
    sampler = Sampler(m, str(data))
    engines = {BASE: {"trainer": Trainer(m, str(data)), "sampler": sampler}}
    app = create_app(settings, config, EngineClient(engines, ray_handles=False))
    limited_engine = GatedEngineClient(engines)
    limited_app = create_app(
        settings,
        ServerConfig(long_poll_seconds=0.5, max_concurrent_samples_per_user=1),
        limited_engine,
    )
    with TestClient(app) as client, TestClient(limited_app) as limited:
        yield SimpleNamespace(
            client=client,
            limited=limited,
            limited_engine=limited_engine,
            limited_app=limited_app,
            keys=keys,
            uids=uids,
            sampler=sampler,
        )
    sampler_close = getattr(sampler, "close", None)
    if sampler_close is not None:
        sampler_close()


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


def _wait_future(client: TestClient, key: str, fut: dict) -> dict:
    for _ in range(100):
        r = client.post("/api/v1/retrieve_future", json=fut, headers={"X-API-Key": key})
        assert r.status_code == 200, r.text
        if r.headers["content-type"].startswith("application/json"):
            body = r.json()
            if body.get("type") == "try_again":
                continue
            return body
        return {"proto": r.content}
    raise AssertionError("future never finished")


@pytest.fixture(scope="module")
def bobs_checkpoint(env) -> str:
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
    model_id = _wait_future(c, key, fut.json())["model_id"]
    fut = c.post(
        "/api/v1/save_weights_for_sampler",
        headers=h,
        json={"model_id": model_id, "seq_id": 1, "path": "bobs"},
    )
    path = _wait_future(c, key, fut.json())["path"]
    assert path == f"tinker://{model_id}/sampler_weights/bobs"
    return path


# ------------------------------------------------------------------------------------ models


def test_models_lists_the_base_model(env):
    ids = [m.id for m in oai(env).models.list().data]
    assert BASE in ids
    assert oai(env).models.retrieve(BASE).id == BASE


def test_models_lists_own_sampler_checkpoints_only(env, bobs_checkpoint):
    assert bobs_checkpoint in [m.id for m in oai(env, "bob").models.list().data]
    assert bobs_checkpoint not in [m.id for m in oai(env, "alice").models.list().data]


# -------------------------------------------------------------------------------------- chat


def test_chat_streaming_and_not_give_the_same_text(env):
    kw = {"model": BASE, "messages": MESSAGES, "max_tokens": 24, "temperature": 0}
    whole = oai(env).chat.completions.create(**kw)
    chunks = list(
        oai(env).chat.completions.create(**kw, stream=True, stream_options={"include_usage": True})
    )
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert whole.object == "chat.completion" and whole.id.startswith("chatcmpl-")
    assert whole.choices[0].message.role == "assistant"
    assert streamed == whole.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    finals = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finals == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)


def test_stream_is_sse_ending_with_done(env):
    r = env.client.post(
        "/v1/chat/completions",
        headers={"Authorization": f"Bearer {env.keys['alice']}"},
        json={
            "model": BASE,
            "messages": MESSAGES,
            "max_tokens": 5,
            "temperature": 0,
            "stream": True,
        },
    )
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = r.text.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    assert all(e.startswith("data: {") for e in events[:-2])


def test_greedy_chat_equals_the_engine_sample_decoded(env):
    prompt = direct(env, "encode_chat", MESSAGES)
    out = direct(
        env,
        "sample",
        SampleInput(prompt_tokens=prompt, params=SamplingParams(max_tokens=20, temperature=0.0)),
    )
    tokens = out.sequences[0].tokens
    expected = env.sampler.backend.tokenizer.decode(tokens, skip_special_tokens=True)
    res = oai(env).chat.completions.create(
        model=BASE, messages=MESSAGES, max_completion_tokens=20, temperature=0
    )
    assert res.choices[0].message.content == expected
    assert res.choices[0].finish_reason == ("length" if len(tokens) == 20 else "stop")
    assert res.usage.prompt_tokens == len(prompt)
    assert res.usage.completion_tokens == len(tokens)
    assert res.usage.total_tokens == len(prompt) + len(tokens)


def test_chat_logprobs_are_the_chosen_tokens(env):
    res = oai(env).chat.completions.create(
        model=BASE, messages=MESSAGES, max_tokens=8, temperature=0, logprobs=True
    )
    content = res.choices[0].logprobs.content
    assert 1 <= len(content) <= 8
    assert "".join(t.token for t in content) == res.choices[0].message.content
    assert all(t.logprob <= 0 and t.top_logprobs == [] for t in content)


def test_chat_n_and_seed(env):
    kw = {"model": BASE, "messages": MESSAGES, "max_tokens": 6, "temperature": 1.0, "seed": 11}
    kw["n"] = 3
    a = oai(env).chat.completions.create(**kw)
    b = oai(env).chat.completions.create(**kw)
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]


def test_content_parts_are_joined(env):
    parts = [{"type": "text", "text": "Tell me about "}, {"type": "text", "text": "the cat."}]
    a = oai(env).chat.completions.create(
        model=BASE,
        messages=[MESSAGES[0], {"role": "user", "content": parts}],
        max_tokens=6,
        temperature=0,
    )
    b = oai(env).chat.completions.create(model=BASE, messages=MESSAGES, max_tokens=6, temperature=0)
    assert a.choices[0].message.content == b.choices[0].message.content


# ------------------------------------------------------------------------------- completions


def test_stop_string_is_cut_from_the_text(env):
    kw = {"model": BASE, "prompt": "The cat sat on the", "max_tokens": 24, "temperature": 0}
    full = oai(env).completions.create(**kw).choices[0].text
    assert len(full) >= 6, full
    stop = full[3:6]
    expected = full[: full.find(stop)]
    res = oai(env).completions.create(**kw, stop=[stop, "never-appears"])
    assert res.choices[0].text == expected and stop not in res.choices[0].text
    assert res.choices[0].finish_reason == "stop"
    assert res.usage.completion_tokens < 24  # the engine stopped early too
    streamed = "".join(
        c.choices[0].text
        for c in oai(env).completions.create(**kw, stop=stop, stream=True)
        if c.choices
    )
    assert streamed == expected
    chat = oai(env).chat.completions.create(
        model=BASE, messages=MESSAGES, max_tokens=24, temperature=0
    )
    text = chat.choices[0].message.content
    if len(text) >= 4:
        cut = oai(env).chat.completions.create(
            model=BASE, messages=MESSAGES, max_tokens=24, temperature=0, stop=text[2:4]
        )
        assert cut.choices[0].message.content == text[: text.find(text[2:4])]


def test_completion_usage_and_logprobs(env):
    prompt = "The cat sat on the"
    ptoks = direct(env, "encode_text", prompt)
    res = oai(env).completions.create(
        model=BASE, prompt=prompt, max_tokens=10, temperature=0, logprobs=1
    )
    c = res.choices[0]
    assert res.object == "text_completion" and res.id.startswith("cmpl-")
    assert res.usage.prompt_tokens == len(ptoks)
    assert 1 <= res.usage.completion_tokens <= 10
    lp = c.logprobs
    assert "".join(lp.tokens) == c.text
    assert len(lp.token_logprobs) == len(lp.tokens) == len(lp.text_offset)
    assert all(v <= 0 for v in lp.token_logprobs)
    assert lp.text_offset[0] == 0


def test_completion_several_prompts_and_token_prompts(env):
    ptoks = direct(env, "encode_text", "A dog")
    res = oai(env).completions.create(
        model=BASE, prompt=["The cat", "A dog"], max_tokens=5, temperature=0, n=2
    )
    assert [c.index for c in res.choices] == [0, 1, 2, 3]
    by_tokens = oai(env).completions.create(model=BASE, prompt=ptoks, max_tokens=5, temperature=0)
    assert by_tokens.choices[0].text == res.choices[2].text


# ------------------------------------------------------------------------------------ errors


def test_unknown_model_is_404_naming_model(env):
    with pytest.raises(openai.NotFoundError) as ei:
        oai(env).chat.completions.create(model="no/such-model", messages=MESSAGES)
    assert "model" in str(ei.value)
    with pytest.raises(openai.NotFoundError):
        oai(env).completions.create(model="tinker://nope:train:0/sampler_weights/x", prompt="hi")


def test_missing_key_is_401(env):
    r = env.client.post("/v1/chat/completions", json={"model": BASE, "messages": MESSAGES})
    assert r.status_code == 401
    r = env.client.get("/v1/models")
    assert r.status_code == 401
    bad = openai.OpenAI(
        base_url="http://testserver/v1", api_key="tml-wrong", http_client=env.client, max_retries=0
    )
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


def test_another_users_checkpoint_is_404(env, bobs_checkpoint):
    twinkle_path = bobs_checkpoint.replace("tinker://", "twinkle://")
    for path in (bobs_checkpoint, twinkle_path):
        with pytest.raises(openai.NotFoundError) as ei:
            oai(env, "alice").chat.completions.create(model=path, messages=MESSAGES, max_tokens=3)
        assert "model" in str(ei.value)
    # the owner may use it (by either scheme, and in the "<base>;<path>" form)
    for model in (bobs_checkpoint, twinkle_path, f"{BASE};{bobs_checkpoint}"):
        res = oai(env, "bob").chat.completions.create(
            model=model, messages=MESSAGES, max_tokens=3, temperature=0
        )
        assert res.model == model and res.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"temperature": 5}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"n": 0}, "n"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"top_logprobs": 3, "logprobs": True}, "top_logprobs"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
        ({"presence_penalty": 0.5}, "presence_penalty"),
        ({"stop": [""]}, "stop"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0]"),
        ({"max_tokens": 100000}, "max_tokens"),
    ],
)
def test_bad_chat_parameters_are_400_naming_the_field(env, body, field):
    req = {"model": BASE, "messages": MESSAGES, "max_tokens": 4, **body}
    r = env.client.post(
        "/v1/chat/completions",
        json=req,
        headers={"Authorization": f"Bearer {env.keys['alice']}"},
    )
    assert r.status_code == 400, r.text
    assert field in r.json()["error"]["message"]


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"logprobs": 3}, "logprobs"),
        ({"echo": True}, "echo"),
        ({"prompt": ""}, "prompt"),
        ({"prompt": []}, "prompt"),
        ({"suffix": "x"}, "suffix"),
    ],
)
def test_bad_completion_parameters_are_400_naming_the_field(env, body, field):
    req = {"model": BASE, "prompt": "The cat", "max_tokens": 4, **body}
    r = env.client.post(
        "/v1/completions", json=req, headers={"Authorization": f"Bearer {env.keys['alice']}"}
    )
    assert r.status_code == 400, r.text
    assert field in r.json()["error"]["message"]


# ------------------------------------------------------------------------ concurrency limit


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
    assert _held(env.limited_app.state.quotas, env.uids["alice"]) == 0
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
        quotas = env.limited_app.state.quotas
        assert _held(quotas, env.uids["alice"]) == 1
        r = client.post("/v1/completions", headers=h, json={"model": BASE, "prompt": "hi"})
        assert r.status_code == 429
        eng.gate.set()
        res = _wait_future(client, env.keys["alice"], fut.json())
        assert "proto" in res, res
    finally:
        eng.gate.set()
    deadline = time.monotonic() + 10
    while _held(quotas, env.uids["alice"]) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _held(quotas, env.uids["alice"]) == 0


# ------------------------------------------------------------------------- response helpers


def test_finish_cuts_at_the_first_stop_and_drops_later_tokens():
    c = responses.finish(0, ["He", "llo", " wor", "ld", ""], [-1, -2, -3, -4, -5], "stop", ["o w"])
    assert c.text == "Hell" and c.pieces == ["He", "ll"] and c.logprobs == [-1, -2]
    assert c.finish_reason == "stop" and c.n_tokens == 5
    c = responses.finish(0, ["a", "", "é", "b"], [-1, -2, -3, -4], "length", [])
    assert c.text == "aéb" and c.pieces == ["a", "", "é", "b"] and c.finish_reason == "length"
    c = responses.finish(0, ["x", ""], [-1, -2], "stop", [])  # trailing EOS adds no text
    assert c.pieces == ["x"] and c.n_tokens == 2


def test_streaming_is_incremental_and_equals_the_whole_text(env):
    """Chunks are sent while the engine is still generating: the first content arrives well
    before the last, in many chunks, and together they equal the non-streamed text (a stop string
    that is cut must never have been sent)."""
    kw = dict(model=BASE, messages=MESSAGES, max_tokens=96, temperature=0)
    whole = oai(env).chat.completions.create(**kw).choices[0].message.content
    t0 = time.perf_counter()
    arrivals: list[tuple[float, str]] = []
    for c in oai(env).chat.completions.create(**kw, stream=True):
        if c.choices and c.choices[0].delta.content:
            arrivals.append((time.perf_counter() - t0, c.choices[0].delta.content))
    assert "".join(t for _, t in arrivals) == whole
    assert len(arrivals) >= 5, arrivals
    first, last = arrivals[0][0], arrivals[-1][0]
    assert first < 0.6 * last, (first, last)  # not all at the end
    # a stop string in the middle of the generated text: streamed == cut text, nothing past it
    stop = whole[len(whole) // 2 : len(whole) // 2 + 3]
    cut = oai(env).chat.completions.create(**kw, stop=[stop]).choices[0].message.content
    streamed = "".join(
        c.choices[0].delta.content or ""
        for c in oai(env).chat.completions.create(**kw, stop=[stop], stream=True)
        if c.choices
    )
    assert streamed == cut and stop not in streamed
