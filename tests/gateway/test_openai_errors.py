"""The OpenAI-compatible API's errors (real in-process engine, real SQLite, the official `openai`
package): unknown models, missing keys, other users' checkpoints, bad parameters naming the
field."""

from __future__ import annotations

import openai
import pytest

from tests.gateway.harness import BASE
from tests.gateway.openai_helpers import MESSAGES, bobs_checkpoint_path, oai, openai_env


@pytest.fixture(scope="module")
def env(make_gateway):
    return openai_env(make_gateway)


@pytest.fixture(scope="module")
def bobs_checkpoint(env) -> str:
    return bobs_checkpoint_path(env)


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
