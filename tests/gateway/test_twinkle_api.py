"""Native Twinkle API in process: the real gateway app, a real Trainer and Sampler on the tiny
model, real SQLite, and the real `twinkle_client` talking to it through the app's ASGI transport.

Checks that the remote class is the engine's class (same losses as in process, same errors),
ownership across users (404), checkpoints shared with the Tinker routes, sampling, and 4xx on bad
input that name the problem.
"""

from __future__ import annotations

import json
import time

import httpx
import numpy as np
import pytest

import twinkle_client
from engine.base_models.registry import resolve_model_dir
from engine.local.model import MultiLoraTransformersModel as LocalModel
from tests.twinkle_scripts import BASE, dpo_step, grpo_step, hf_data, roll, sft_script
from twinkle_client.model import MultiLoraTransformersModel as RemoteModel
from twinkle_client.sampler import vLLMSampler


class _Transport(httpx.BaseTransport):
    """Starlette's TestClient transport with a plain sync body, as a bare httpx.Client expects."""

    def __init__(self, inner: httpx.BaseTransport) -> None:
        self.inner = inner

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        r = self.inner.handle_request(request)
        return httpx.Response(r.status_code, headers=r.headers, content=r.read())


@pytest.fixture(scope="module")
def env(make_gateway):
    gw = make_gateway()
    data, tc = gw.data, gw.client
    keys = {u: gw.key(u) for u in ("alice", "bob")}

    def client(user: str, **kw) -> twinkle_client.TwinkleClient:
        kw.setdefault("session_heartbeat_interval", None)
        return twinkle_client.TwinkleClient(
            "http://testserver", keys[user], transport=_Transport(tc._transport), **kw
        )

    yield {
        "tc": tc,
        "client": client,
        "keys": keys,
        "model_dir": resolve_model_dir(BASE, data),
    }


@pytest.fixture(scope="module")
def alice(env):
    return env["client"]("alice")


def test_same_script_in_process_and_remote_gives_equal_losses(env, alice, tmp_path):
    data = roll(hf_data(env["model_dir"]))  # upstream's rows: rolled labels, in process too
    local = sft_script(LocalModel, str(env["model_dir"]), data, data_dir=tmp_path)
    remote = sft_script(RemoteModel, BASE, data, client=alice)
    assert len(local["losses"]) == len(remote["losses"]) == 8
    np.testing.assert_allclose(remote["losses"], local["losses"], rtol=0, atol=1e-5)
    np.testing.assert_allclose(remote["resumed"], local["resumed"], rtol=0, atol=1e-5)
    # gradient norms (clip_grad_norm / clip_grad_and_step) match too; zero_grad dropped the probe
    assert remote["probe_norm"] > 0
    np.testing.assert_allclose(remote["probe_norm"], local["probe_norm"], rtol=1e-5)
    np.testing.assert_allclose(remote["norms"], local["norms"], rtol=1e-5, atol=1e-6)
    # save + resume_from_checkpoint continue the exact trajectory of the uninterrupted run
    np.testing.assert_allclose(remote["resumed"], remote["losses"][4:], rtol=0, atol=1e-5)
    assert remote["losses"][-1] < remote["losses"][0]
    assert remote["resume_info"]["consumed_train_samples"] == 8
    assert remote["resume_info"]["cur_step"] == local["resume_info"]["cur_step"] == 2
    assert local["resume_info"]["consumed_train_samples"] == 8
    assert remote["metric"]["step"] == local["metric"]["step"]
    assert remote["ckpt"].startswith("twinkle://")

    # the checkpoint is a checkpoint of the adapter's training run, listed by both APIs
    run_id = remote["ckpt"].removeprefix("twinkle://").split("/")[0]
    ckpts = alice.list_checkpoints(run_id)
    assert [c.twinkle_path for c in ckpts] == [remote["ckpt"]]
    tinker_list = env["tc"].get(
        f"/api/v1/training_runs/{run_id}/checkpoints", headers={"X-API-Key": env["keys"]["alice"]}
    )
    assert tinker_list.json()["checkpoints"][0]["tinker_path"] == "tinker://" + remote["ckpt"][10:]
    assert any(r.training_run_id == run_id for r in alice.list_training_runs(limit=100))
    info = alice.get_checkpoint(remote["ckpt"])
    assert info.model_dump()["run_id"] == run_id and (info.size_bytes or 0) > 0


def test_dpo_and_grpo_steps(env, alice):
    dpo = dpo_step(RemoteModel, BASE, roll(hf_data(env["model_dir"])), client=alice)
    assert np.isfinite(dpo["loss"]) and dpo["metrics"]["grad_norm"] > 0
    grpo = grpo_step(RemoteModel, vLLMSampler, BASE, client=alice)
    assert grpo["num_sequences"] == 4 and all(t for t in grpo["texts"])
    assert np.isfinite(grpo["loss"]) and grpo["metrics"]["grad_norm"] > 0


def test_sampling_returns_tokens_logprobs_text_and_features(alice, env):
    s = vLLMSampler(BASE, client=alice)
    s.set_template("Qwen3_5Template", model_id=BASE, max_length=64)
    traj = {"messages": [{"role": "user", "content": "What is 2 plus 2?"}]}
    (res,) = s.sample(
        inputs=[traj],
        sampling_params={"max_tokens": 5, "temperature": 0.0, "num_samples": 2, "logprobs": 1},
    )
    assert len(res.sequences) == 2
    a, b = res.sequences
    assert a.tokens == b.tokens and len(a.tokens) <= 5  # greedy
    assert len(a.logprobs) == len(a.tokens) and a.logprobs[0][0][0] == a.tokens[0]
    assert all(lp <= 0 for lp in a.token_logprobs) and isinstance(a.decoded, str)
    f = a.new_input_feature
    prompt_tokens = res.model_dump()["prompt_tokens"]  # ours, beyond upstream's fields
    n = len(prompt_tokens)
    assert f["input_ids"] == prompt_tokens + a.tokens
    # rolled as upstream's templates write them: position i's target is input_ids[i + 1]
    assert f["labels"][: n - 1] == [-100] * (n - 1) and f["labels"][n - 1 : -1] == a.tokens
    assert f["labels"][-1] == -100 and f["length"] == n + len(a.tokens)
    # an encoded feature samples the same as its trajectory
    (again,) = s.sample([{"input_ids": prompt_tokens}], {"max_tokens": 5, "temperature": 0.0})
    assert again.sequences[0].tokens == a.tokens


def test_management_calls_and_heartbeats(env):
    c = env["client"]("alice", session_heartbeat_interval=0.2)
    caps = c.get_server_capabilities()
    assert caps.supported_models[0].model_name == BASE
    cap = (c.get_capacity_info().models or [])[0]
    assert cap["base_model"] == BASE and cap["max_loras"] >= cap["used_loras"] >= 0
    deadline = time.monotonic() + 10
    while c.heartbeats < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert c.heartbeats >= 2
    c.close()
    files = {
        f["name"]
        for f in env["client"]("bob").get("twinkle/tokenizer", {"base_model": BASE})["files"]
    }
    assert {"tokenizer.json", "tokenizer_config.json"} <= files
    body = env["tc"].get(
        "/api/v1/twinkle/tokenizer/tokenizer.json",
        params={"base_model": BASE},
        headers={"X-API-Key": env["keys"]["bob"]},
    )
    assert (
        body.status_code == 200
        and body.content == (env["model_dir"] / "tokenizer.json").read_bytes()
    )
    anon = env["tc"].get("/api/v1/twinkle/tokenizer", params={"base_model": BASE})
    assert anon.status_code == 401
    bad = env["tc"].get(
        "/api/v1/twinkle/tokenizer/secret.txt",
        params={"base_model": BASE},
        headers={"X-API-Key": env["keys"]["bob"]},
    )
    assert bad.status_code == 404 and "filename" in bad.json()["detail"]


def test_other_users_resources_are_404(env, alice):
    m = RemoteModel(BASE, client=alice)
    m.add_adapter_to_model("owned", {"r": 4, "target_modules": "all-linear"})
    path = m.save("mine", is_sampler=True).twinkle_path
    bob = env["client"]("bob")
    # bob sends alice's session id (the handle of her model): 404 naming the session
    bob._http.headers["X-Twinkle-Session-Id"] = alice.session_id
    with pytest.raises(twinkle_client.NotFoundError, match="session"):
        RemoteModel(BASE, client=bob)
    bob._http.headers["X-Twinkle-Session-Id"] = bob.session_id
    with pytest.raises(twinkle_client.NotFoundError, match="checkpoint"):
        bob.get_checkpoint(path)
    with pytest.raises(twinkle_client.NotFoundError):
        bob.delete_checkpoint(path)
    own = RemoteModel(BASE, client=bob)  # bob's model in his session has no alice adapter
    with pytest.raises(twinkle_client.NotFoundError, match="owned"):
        own.get_train_configs(adapter_name="owned")
    own.add_adapter_to_model("owned", {"r": 4})  # bob's own adapter of that name
    with pytest.raises(twinkle_client.NotFoundError, match="checkpoint"):
        own.load(path)
    with pytest.raises(twinkle_client.NotFoundError, match="adapter_uri"):
        vLLMSampler(BASE, client=bob).sample([{"input_ids": [1, 2, 3]}], adapter_uri=path)
    run_id = path.removeprefix("twinkle://").split("/")[0]
    with pytest.raises(twinkle_client.NotFoundError):
        bob.list_checkpoints(run_id)
    with pytest.raises(twinkle_client.NotFoundError, match="session"):
        bob.post("twinkle/session_heartbeat", {"session_id": alice.session_id})
    # alice removes and re-adds her adapter: the run and its checkpoints carry on
    m.remove_adapter()
    m.add_adapter_to_model("owned", {"r": 8})
    assert json.loads(m.get_train_configs().result)["lora"]["r"] == 8
    assert [c.twinkle_path for c in alice.list_checkpoints(run_id)] == [path]
    alice.delete_checkpoint(path)
    with pytest.raises(twinkle_client.NotFoundError):
        alice.get_checkpoint(path)
    m.close()  # frees the adapters; the run stays listed
    with pytest.raises(twinkle_client.NotFoundError, match="owned"):
        m.get_train_configs(adapter_name="owned")
    assert any(r.training_run_id == run_id for r in alice.list_training_runs(limit=1000))


def test_bad_input_is_4xx_naming_the_problem(env, alice):
    m = RemoteModel(BASE, client=alice)
    with pytest.raises(twinkle_client.InvalidRequestError, match="target_modules"):
        m.add_adapter_to_model("bad", {"r": 4, "target_modules": ["embed_tokens"]})
    m.add_adapter_to_model("checks", {"r": 4})
    cases = [
        (lambda: m.set_loss("FancyLoss"), "unknown loss 'FancyLoss'"),
        (lambda: m.set_template("NoSuchTemplate"), "unknown template 'NoSuchTemplate'"),
        (lambda: m.set_processor("NoSuchProcessor"), "unknown processor"),
        (lambda: m.forward_backward([{"input_ids": "abc"}]), "inputs\\[0\\].input_ids"),
        (lambda: m.forward_backward([{"foo": 1}]), "inputs\\[0\\]"),
        (lambda: m.forward_backward([{"input_ids": [1, 2], "labels": [1]}]), "labels"),
        (lambda: m.forward_backward([{"input_ids": [5, 10**9]}]), "vocab"),
        (lambda: m.forward_backward([{"input_ids": [5, 6]}], bogus=1), "bogus"),
        (lambda: m.calculate_metric(bogus=1), "bogus"),
        (lambda: m.set_optimizer("SGD"), "accepted: AdamW, Adam"),
        (lambda: m.step(), "no gradient"),
        (lambda: m.save("../x"), "name"),
        (lambda: m.load("never-saved"), "not found"),
        (lambda: m.add_adapter_to_model("checks", {"r": 4}), "exists already"),
        # names are matched whole: "$" alone would let a trailing newline through
        (lambda: m.add_adapter_to_model("checks\n", {"r": 4}), "adapter_name"),
        (lambda: m.save("ck\n"), "name"),
        (lambda: m.set_lr_scheduler("cosine"), "total_steps"),
        (lambda: vLLMSampler(BASE, client=alice).set_template("Nope"), "unknown template"),
        (
            lambda: vLLMSampler("no/such-model", client=alice).sample({"input_ids": [1]}),
            "base_model",
        ),
        (lambda: RemoteModel("no/such-model", client=alice), "base_model"),
    ]
    for call, pattern in cases:
        with pytest.raises(
            (twinkle_client.InvalidRequestError, twinkle_client.NotFoundError), match=pattern
        ):
            call()
    with pytest.raises(twinkle_client.NotFoundError, match="not a model method"):
        alice.post(f"model/{BASE}/twinkle/__init__", {"adapter_name": "checks"})
    # the server keeps serving after all that
    out = m.forward_backward([{"input_ids": [5, 6, 7, 8]}], label_format="hf").result
    assert np.isfinite(out["loss"]) and len(out["logprobs"][0]) == 3


def test_templates_encode_through_the_server(env, alice):
    from tokenizers import Tokenizer

    from twinkle_client.dataset import Dataset, dpo_batch
    from twinkle_client.template import Qwen3_5Template, Template

    tok = Tokenizer.from_file(str(env["model_dir"] / "tokenizer.json"))
    t = Template(BASE, client=alice)
    traj = {
        "messages": [
            {"role": "user", "content": "Who are you?"},
            {"role": "assistant", "content": "I am Twinkle."},
        ],
        "id": 7,
    }
    f = t.encode(traj)
    text = (
        "<|im_start|>user\nWho are you?<|im_end|>\n<|im_start|>assistant\nI am Twinkle.<|im_end|>\n"
    )
    assert f["input_ids"] == tok.encode(text, add_special_tokens=False).ids
    # rolled labels (upstream's): labels[i] is the target of input_ids[i]
    trained = [lab for lab in f["labels"] if lab != -100]
    assert tok.decode(trained, skip_special_tokens=False) == "I am Twinkle.<|im_end|>"
    assert f["labels"][:-1] == [
        lab if lab == -100 else f["input_ids"][i + 1] for i, lab in enumerate(f["labels"][:-1])
    ]
    assert f["id"] == 7  # other keys of the row are kept
    short = Qwen3_5Template(BASE, max_length=5, client=alice).encode(traj)
    assert len(short["input_ids"]) == 5
    gen = t.encode({"messages": traj["messages"][:1]}, add_generation_prompt=True)
    assert tok.decode(gen["input_ids"][-3:], skip_special_tokens=False).endswith("assistant\n")
    # a model accepts the template object (its name is sent)
    m = RemoteModel(BASE, client=alice)
    m.add_adapter_to_model("tmpl", {"r": 4})
    m.set_template(Qwen3_5Template(BASE, client=alice))
    assert "Qwen3_5Template" in json.loads(m.get_train_configs().result)["template"]
    # a DPO dataset encodes both sides and trains as pairs
    ds = Dataset(
        [
            {"prompt": "Say hi.", "chosen": "Hi!", "rejected": "No."},
            {"prompt": "Count to two.", "chosen": "One, two.", "rejected": "Three."},
        ]
    ).map("DPOProcessor")
    ds.encode(t)
    batch = dpo_batch(ds.rows)
    assert len(batch) == 4 and all("input_ids" in b for b in batch)
    m.set_loss("DPOLoss", beta=0.1)
    out = m.forward_backward(inputs=batch).result
    assert np.isfinite(out["loss"]) and "dpo_accuracy:mean" in out["metrics"]
    with pytest.raises(twinkle_client.InvalidRequestError, match="messages\\[0\\].role"):
        t.encode({"messages": [{"role": "wizard", "content": "x"}]})
