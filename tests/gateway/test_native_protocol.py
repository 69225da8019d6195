"""Upstream Twinkle's native protocol (``/api/v1/model/<base>/twinkle/<method>``,
``/api/v1/sampler/<base>/twinkle/<method>``) on the real gateway app with a real Trainer and
Sampler on the tiny model: the bodies upstream's client (twinkle-kit 0.5.1) sends, answered in
the shapes it parses; sessions and ownership; 4xx naming the field on bad input."""

from __future__ import annotations

import json

import pytest

BASE = "twinkle/tiny-chat"
M = f"/api/v1/model/{BASE}/twinkle"
S = f"/api/v1/sampler/{BASE}/twinkle"
LORA = json.dumps(
    {"_TWINKLE_TYPE_": "LoraConfig", "r": 8, "lora_alpha": 32, "target_modules": "all-linear",
     "lora_dropout": 0.05, "bias": "none", "task_type": None}
)  # fmt: skip


class User:
    def __init__(self, tc, key: str):
        self.tc, self.key = tc, key
        r = tc.post("/api/v1/twinkle/create_session", json={"metadata": None}, headers=self.h())
        assert r.status_code == 200, r.text
        self.session = r.json()["session_id"]

    def h(self, session: str | None = None) -> dict:
        h = {"Authorization": f"Bearer {self.key}", "Twinkle-Authorization": f"Bearer {self.key}"}
        h["x-request-id"] = "20261203_120000-abcd1234"
        if getattr(self, "session", None) or session:
            h["X-Twinkle-Session-Id"] = session or self.session
        return h

    def post(self, path: str, body: dict | None = None, ok: bool = True, **kw):
        r = self.tc.post(path, json=body if body is not None else {}, headers=self.h(**kw))
        if ok:
            assert r.status_code == 200, r.text
            return r.json()
        return r


@pytest.fixture(scope="module")
def env(make_gateway):
    gw = make_gateway()
    return gw, User(gw.client, gw.key("alice")), User(gw.client, gw.key("bob"))


def _rows(n: int = 2) -> list[dict]:
    """Encoded rows as upstream's template writes them (rolled labels plus dataset columns)."""
    rows = []
    for i in range(n):
        ids = [5 + i, 17, 33, 41, 52, 60, 7, 9]
        labels = [-100, -100, -100, 41, 52, 60, 7, -100]
        rows.append(
            {"input_ids": ids, "labels": labels, "attention_mask": [1] * 8,
             "position_ids": list(range(8)), "length": 8, "query": "q", "tag": i,
             "messages": [{"role": "user", "content": "hi", "tool_calls": None}]}
        )  # fmt: skip
    return rows


def test_training_loop_in_upstream_shapes(env):
    _, a, _ = env
    assert a.post(f"{M}/create")["status"] == "ok"
    a.post(f"{M}/add_adapter_to_model", {"adapter_name": "default", "config": LORA,
           "gradient_accumulation_steps": 1, "save_dir": "/home/someone/out"})  # fmt: skip
    assert a.post(f"{M}/set_template", {"template_cls": "Qwen3_5Template",
                  "adapter_name": "default", "model_id": BASE}) == {"status": "ok"}  # fmt: skip
    a.post(f"{M}/set_processor", {"processor_cls": "InputProcessor", "adapter_name": "default",
           "padding_side": "right"})  # fmt: skip
    a.post(f"{M}/set_loss", {"loss_cls": "CrossEntropyLoss", "adapter_name": "default"})
    a.post(f"{M}/set_optimizer", {"optimizer_cls": "AdamW", "adapter_name": "default", "lr": 1e-3})
    cfg = a.post(f"{M}/get_train_configs", {"adapter_name": "default"})["result"]
    assert isinstance(cfg, str) and "CrossEntropyLoss" in cfg
    out = a.post(f"{M}/forward_backward", {"inputs": _rows(), "adapter_name": "default"})
    assert out["result"]["loss"] > 0
    assert a.post(f"{M}/clip_grad_and_step", {"max_grad_norm": 1.0, "norm_type": 2,
                  "adapter_name": "default"})["status"] == "ok"  # fmt: skip
    metric = a.post(f"{M}/calculate_metric", {"is_training": True, "adapter_name": "default"})
    assert isinstance(metric["result"], dict)
    saved = a.post(f"{M}/save", {"name": "step-1", "adapter_name": "default",
                   "save_optimizer": True, "consumed_train_samples": 2})  # fmt: skip
    assert saved["twinkle_path"].startswith("twinkle://")
    assert saved["checkpoint_dir"] == saved["twinkle_path"]  # never a server directory
    prog = a.post(f"{M}/resume_from_checkpoint", {"name": saved["twinkle_path"],
                  "adapter_name": "default", "resume_only_model": False})["result"]  # fmt: skip
    assert prog["consumed_train_samples"] == 2
    # the run is listed by the management routes upstream's client parses
    runs = a.tc.get("/api/v1/twinkle/training_runs", headers=a.h()).json()["training_runs"]
    assert any(r["training_run_id"].endswith(":default") for r in runs)


def test_sampler_routes(env):
    _, a, _ = env
    a.post(f"{S}/create")
    a.post(f"{S}/set_template", {"template_cls": "Qwen3_5Template", "adapter_name": "",
           "model_id": f"ms://{BASE}"})  # fmt: skip
    body = {"inputs": [{"messages": [{"role": "user", "content": "hello"}], "q": 1}],
            "sampling_params": {"max_tokens": 5, "temperature": 1.0, "num_samples": 2,
                                "logprobs": 1, "seed": 3},
            "adapter_name": "", "num_samples": 1}  # fmt: skip
    out = a.post(f"{S}/sample", body)
    (sample,) = out["samples"]
    assert len(sample["sequences"]) == 2
    seq = sample["sequences"][0]
    assert len(seq["logprobs"]) == len(seq["tokens"])
    assert seq["logprobs"][0][0][0] == seq["tokens"][0]
    f = seq["new_input_feature"]
    assert f["q"] == 1 and f["messages"][-1]["role"] == "assistant"
    assert f["input_ids"][-len(seq["tokens"]) :] == seq["tokens"]
    # rolled: the last prompt position's target is the first sampled token
    n = len(seq["tokens"])
    assert f["labels"][-n - 1 : -1] == seq["tokens"] and f["labels"][-1] == -100
    assert f["length"] == len(f["input_ids"]) == len(f["labels"])


def test_sessions_and_ownership(env):
    _, a, b = env
    a.post(f"{M}/create")
    # bob cannot use alice's session (404), and has no model in his own
    r = b.post(f"{M}/forward_backward", {"inputs": _rows(), "adapter_name": "default"},
               ok=False, session=a.session)  # fmt: skip
    assert r.status_code == 404, r.text
    r = b.post(f"{M}/forward_backward", {"inputs": _rows(), "adapter_name": "default"}, ok=False)
    assert r.status_code == 404 and "create" in r.text
    # no session header: a 400 naming it
    r = a.tc.post(f"{M}/create", json={}, headers={"Authorization": f"Bearer {a.key}"})
    assert r.status_code == 400 and "X-Twinkle-Session-Id" in r.text


@pytest.mark.parametrize(
    "path,body,status,words",
    [
        (f"{M}/set_loss", {"loss_cls": "os.system", "adapter_name": "default"}, 400, ["loss"]),
        (f"{M}/set_loss", {"adapter_name": "default"}, 400, ["loss_cls"]),
        (f"{M}/forward_backward", {"inputs": [{"input_ids": "x"}], "adapter_name": "default"},
         400, ["input_ids"]),
        (f"{M}/forward_backward", {"inputs": [], "adapter_name": "default"}, 400, ["inputs"]),
        (f"{M}/forward_backward", {"inputs": _rows(), "adapter_name": "default", "bogus": 1},
         400, ["bogus"]),
        (f"{M}/add_adapter_to_model", {"adapter_name": "x2", "config": "{bad json"}, 400,
         ["config"]),
        (f"{M}/add_adapter_to_model", {"adapter_name": "x3", "config": json.dumps({"r": 8,
         "use_dora": True})}, 400, ["use_dora"]),
        (f"{M}/upload_to_hub", {"checkpoint_dir": "twinkle://x", "hub_model_id": "a/b"}, 501,
         ["not available"]),
        (f"{M}/no_such_method", {}, 404, ["method"]),
        ("/api/v1/model/nope/model/twinkle/create", {}, 404, ["base_model"]),
        (f"{S}/sample", {"inputs": [{"messages": []}], "sampling_params": {"max_tokens": 0}},
         400, ["max_tokens"]),
        (f"{S}/sample", {"inputs": [{"messages": [{"role": "user", "content": "x"}]}],
         "sampling_params": {"repetition_penalty": 1.2}}, 400, ["repetition_penalty"]),
        (f"{S}/sample", {"inputs": [{"messages": [{"role": "user", "content": "x"}]}],
         "adapter_uri": "twinkle://nope/weights/x"}, 404, ["adapter_uri"]),
        (f"{S}/add_adapter_to_sampler", {"adapter_name": "a", "config": {}}, 501,
         ["adapter_uri"]),
    ],
)  # fmt: skip
def test_bad_input_is_a_4xx_naming_the_field(env, path, body, status, words):
    _, a, _ = env
    a.post(f"{M}/create")
    r = a.post(path, body, ok=False)
    assert r.status_code == status, r.text
    for w in words:
        assert w in r.text, r.text
    # the server keeps serving
    assert a.post(f"{M}/create")["status"] == "ok"


def test_training_tokens_are_metered_and_rate_limited(make_gateway):
    from sqlmodel import Session, select

    from gateway.db import make_engine
    from gateway.db.tables import UsageBucketRow
    from tests.gateway.harness import set_quota

    gw = make_gateway()
    u = User(gw.client, gw.key("carol"))
    u.post(f"{M}/create")
    u.post(f"{M}/add_adapter_to_model", {"adapter_name": "default", "config": LORA})
    u.post(f"{M}/forward_backward", {"inputs": _rows(2), "adapter_name": "default"})
    with Session(make_engine(gw.db_url)) as s:
        rows = s.exec(select(UsageBucketRow).where(UsageBucketRow.kind == "training")).all()
    assert sum(r.quantity for r in rows) == 16  # two rows of 8 input tokens
    # the training-token rate of the Tinker routes holds here too: 429 + retry-after
    set_quota(gw.db_url, "user", "carol", "train_tokens_per_minute", 20)
    r = u.post(f"{M}/forward_backward", {"inputs": _rows(3), "adapter_name": "default"}, ok=False)
    assert r.status_code in (403, 429), r.text
    assert "train_tokens_per_minute" in r.text


def test_either_auth_header_and_hub_prefixes(env):
    gw, a, _ = env
    for path in (
        f"/api/v1/model/ms://{BASE}/twinkle/create",
        f"/api/v1/model/hf://{BASE}/twinkle/create",
    ):
        h = {"Twinkle-Authorization": f"Bearer {a.key}", "X-Twinkle-Session-Id": a.session}
        r = gw.client.post(path, json={}, headers=h)
        assert r.status_code == 200, r.text
    r = gw.client.post(f"{M}/create", json={}, headers={"X-Twinkle-Session-Id": a.session})
    assert r.status_code == 401


def test_sample_stream_is_ndjson_and_equals_sample(env):
    _, a, _ = env
    a.post(f"{S}/create")
    body = {"inputs": [{"messages": [{"role": "user", "content": "hello"}]}],
            "sampling_params": {"max_tokens": 6, "temperature": 0.0}}  # fmt: skip
    full = a.post(f"{S}/sample", body)["samples"][0]["sequences"][0]
    with a.tc.stream("POST", f"{S}/sample_stream", json=body, headers=a.h()) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("application/x-ndjson")
        lines = [json.loads(x) for x in r.iter_lines() if x]
    assert all(set(x) == {"delta", "finish_reason"} for x in lines)
    assert [x["finish_reason"] for x in lines[:-1]] == [None] * (len(lines) - 1)
    assert lines[-1]["finish_reason"] == full["stop_reason"]
    assert "".join(x["delta"] for x in lines) == full["decoded"]
    two = dict(body, sampling_params={"max_tokens": 6, "num_samples": 2})
    r = a.post(f"{S}/sample_stream", two, ok=False)
    assert r.status_code == 400 and "num_samples" in r.text


def test_native_saves_count_against_the_checkpoint_quota(make_gateway):
    """``model.save`` takes a slot of max_checkpoints like Tinker's saves (403 at the cap, naming
    it); overwriting the same name fits its slot; deleting frees it."""
    from tests.gateway.harness import set_quota

    gw = make_gateway()
    u = User(gw.client, gw.key("carol"))
    set_quota(gw.db_url, "user", "carol", "max_checkpoints", 1)
    u.post(f"{M}/create")
    u.post(f"{M}/add_adapter_to_model", {"adapter_name": "default", "config": LORA})
    first = u.post(f"{M}/save", {"name": "a", "adapter_name": "default"})["twinkle_path"]
    u.post(f"{M}/save", {"name": "a", "adapter_name": "default"})  # the same slot again
    over = u.post(f"{M}/save", {"name": "b", "adapter_name": "default"}, ok=False)
    assert over.status_code == 403, over.text
    assert "max_checkpoints" in over.text and "limit 1" in over.text
    r = gw.client.delete("/api/v1/twinkle/checkpoint", params={"path": first}, headers=u.h())
    assert r.status_code == 200, r.text
    assert u.post(f"{M}/save", {"name": "b", "adapter_name": "default"})["twinkle_path"]
