"""twinkle_client against a fake server speaking upstream Twinkle's native protocol: the exact
routes, headers and flat bodies of every model / sampler / management call, the objects they
return, and upstream cookbook-style scripts (self_cognition, dpo, grpo, sample) end to end."""

from __future__ import annotations

import json
import os
import time

import numpy as np
import pytest

import twinkle_client
from tests.unit.client_protocol_helpers import API_KEY, BASE_URL, CKPT, MODEL, FakeServer, M, S
from twinkle_client import init_twinkle_client, types
from twinkle_client._client import REQUEST_ID, ROUTING_HEADERS
from twinkle_client.dataloader import DataLoader
from twinkle_client.dataset import Dataset, DatasetMeta, LazyDataset, dpo_batch
from twinkle_client.model import MultiLoraTransformersModel
from twinkle_client.sampler import TorchSampler, vLLMSampler


@pytest.fixture
def fake():
    return FakeServer()


@pytest.fixture
def client(fake):
    c = init_twinkle_client(
        base_url=BASE_URL,
        api_key=API_KEY,
        session_heartbeat_interval=None,
        transport=fake.transport,
    )
    yield c
    c.close()


@pytest.fixture
def model(client, fake):
    m = MultiLoraTransformersModel(f"ms://{MODEL}")
    m.add_adapter_to_model("default", {"r": 8, "target_modules": "all-linear"})
    return m


def test_session_headers_and_base_url(fake):
    c = init_twinkle_client(
        base_url=BASE_URL + "/api/v1/",
        api_key=API_KEY,
        session_heartbeat_interval=0.02,
        transport=fake.transport,
    )
    try:
        first = fake.requests[0]
        assert (first.method, first.path) == ("POST", "/api/v1/twinkle/create_session")
        assert first.body["metadata"] is None
        assert "x-twinkle-session-id" not in first.headers
        assert c.session_id == "sess-1" and c.base_url == BASE_URL + "/api/v1"
        deadline = time.monotonic() + 5
        while not fake.calls("/session_heartbeat") and time.monotonic() < deadline:
            time.sleep(0.01)
        beat = fake.last("/session_heartbeat")
        assert beat.body == {"session_id": "sess-1"}
        MultiLoraTransformersModel(MODEL)
        for call in (first, beat, fake.last("/create")):
            assert call.headers["authorization"] == f"Bearer {API_KEY}"
            assert call.headers["twinkle-authorization"] == f"Bearer {API_KEY}"
            for name in ROUTING_HEADERS:
                assert call.headers[name] == REQUEST_ID
        assert beat.headers["x-twinkle-session-id"] == "sess-1"
        assert fake.last("/create").headers["x-twinkle-session-id"] == "sess-1"
    finally:
        c.close()


def test_environment_fallbacks(fake, monkeypatch):
    monkeypatch.setenv("TWINKLE_SERVER_URL", BASE_URL)
    monkeypatch.setenv("TWINKLE_SERVER_TOKEN", "tml-env")
    c = init_twinkle_client(session_heartbeat_interval=None, transport=fake.transport)
    assert fake.last("/create_session").headers["authorization"] == "Bearer tml-env"
    c.close()
    monkeypatch.delenv("TWINKLE_SERVER_URL")
    with pytest.raises(twinkle_client.TwinkleError, match="TWINKLE_SERVER_URL"):
        init_twinkle_client(session_heartbeat_interval=None, transport=fake.transport)


def test_model_create_and_add_adapter(model, fake):
    assert fake.last("/create").path == f"{M}/create" and fake.last("/create").body == {}
    add = fake.last(f"{M}/add_adapter_to_model")
    assert add.body == {"adapter_name": "default", "config": add.body["config"]}
    assert json.loads(add.body["config"]) == {"r": 8, "target_modules": "all-linear"}

    class LoraConfig:  # peft-like: public attributes, a set, a private one
        def __init__(self):
            self.r, self.target_modules, self._hidden = 4, {"v_proj", "q_proj"}, 1

    model.add_adapter_to_model("b", LoraConfig(), gradient_accumulation_steps=2, save_dir="/x/y")
    body = fake.last("/add_adapter_to_model").body
    assert json.loads(body["config"]) == {
        "r": 4,
        "target_modules": ["q_proj", "v_proj"],
        "_TWINKLE_TYPE_": "LoraConfig",
    }
    assert body["gradient_accumulation_steps"] == 2 and body["save_dir"] == "/x/y"
    assert model.adapter_name == "b"  # the last added adapter is the default of later calls


SETTERS = [
    (
        "set_template",
        ("Qwen3_5Template",),
        {},
        {"template_cls": "Qwen3_5Template", "model_id": MODEL},
    ),
    (
        "set_processor",
        ("InputProcessor",),
        {"padding_side": "right"},
        {"processor_cls": "InputProcessor", "padding_side": "right"},
    ),
    ("set_loss", ("CrossEntropyLoss",), {}, {"loss_cls": "CrossEntropyLoss"}),
    (
        "set_loss",
        ("DPOLoss",),
        {"beta": 0.1, "loss_type": "sigmoid"},
        {"loss_cls": "DPOLoss", "beta": 0.1, "loss_type": "sigmoid"},
    ),
    ("set_optimizer", ("Adam",), {"lr": 1e-4}, {"optimizer_cls": "Adam", "lr": 1e-4}),
    (
        "set_lr_scheduler",
        ("LinearLR",),
        {"total_iters": 10},
        {"scheduler_cls": "LinearLR", "total_iters": 10},
    ),
    (
        "add_metric",
        ("DPOMetric",),
        {"beta": 0.1},
        {"metric_cls": "DPOMetric", "is_training": None, "beta": 0.1},
    ),
    ("clip_grad_and_step", (), {}, {"max_grad_norm": 1.0, "norm_type": 2}),
    ("clip_grad_norm", (0.5,), {}, {"max_grad_norm": 0.5, "norm_type": 2}),
    ("step", (), {}, {}),
    ("zero_grad", (), {}, {}),
    ("lr_step", (), {}, {}),
    ("backward", (), {}, {}),
    ("calculate_loss", (), {}, {}),
    ("calculate_metric", (), {"is_training": True}, {"is_training": True}),
    ("get_train_configs", (), {}, {}),
    (
        "save",
        ("step-2",),
        {"save_optimizer": True, "consumed_train_samples": 8},
        {"name": "step-2", "save_optimizer": True, "consumed_train_samples": 8},
    ),
    (
        "load",
        ("twinkle://run-1/weights/step-2",),
        {"load_optimizer": True},
        {"name": "twinkle://run-1/weights/step-2", "load_optimizer": True},
    ),
    ("resume_from_checkpoint", ("step-2",), {}, {"name": "step-2", "resume_only_model": False}),
]


@pytest.mark.parametrize(("method", "args", "kwargs", "expected"), SETTERS)
def test_model_call_routes_and_flat_bodies(model, fake, method, args, kwargs, expected):
    getattr(model, method)(*args, **kwargs)
    call = fake.last(f"/{method}")
    assert (call.method, call.path) == ("POST", f"{M}/{method}")
    assert call.body == {"adapter_name": "default", **expected}
    assert call.headers["x-twinkle-session-id"] == "sess-1"


def test_passes_send_inputs_and_extras(model, fake):
    rows = [{"input_ids": [1, 2, 3], "labels": [2, 3, -100]}]
    out = model.forward_only(inputs=rows, disable_lora=True)
    assert fake.last("/forward_only").body == {
        "inputs": rows,
        "adapter_name": "default",
        "disable_lora": True,
    }
    model.forward_backward(inputs=rows, ref_outputs=out.result, adapter_name="other")
    body = fake.last("/forward_backward").body
    assert body["adapter_name"] == "other"  # a call may name another adapter
    assert body["ref_outputs"] == out.result
    arr = [{"input_ids": np.array([1, 2]), "labels": np.array([2, -100])}]
    model.forward(inputs=arr, advantages=np.array([0.5]), old_logps=[[-0.1, -0.2]])
    assert fake.last("/forward").body == {
        "inputs": [{"input_ids": [1, 2], "labels": [2, -100]}],
        "adapter_name": "default",
        "advantages": [0.5],
        "old_logps": [[-0.1, -0.2]],
    }


def test_return_types(model):
    rows = [{"input_ids": [1, 2, 3]}]
    fb = model.forward_backward(inputs=rows)
    assert isinstance(fb, types.ForwardBackwardResponse) and fb.result["loss"] == 1.25
    assert fb["loss"] == 1.25 and fb.get("nope") is None  # indexable like the engine's dict
    assert isinstance(model.forward_only(inputs=rows), types.ForwardResponse)
    assert isinstance(model.forward(inputs=rows), types.ForwardResponse)
    metric = model.calculate_metric(is_training=True)
    assert isinstance(metric, types.CalculateMetricResponse) and metric.result["step"] == 1
    cfg = model.get_train_configs()
    assert isinstance(cfg, types.GetTrainConfigsResponse) and "lr" in cfg.model_dump()["result"]
    norm = model.clip_grad_norm(1.0)
    assert isinstance(norm, types.ClipGradNormResponse) and float(norm) == 0.75
    assert float(model.calculate_loss()) == 1.25
    for void in ("step", "zero_grad", "lr_step", "clip_grad_and_step", "backward"):
        assert getattr(model, void)() is None
    saved = model.save(name="s", save_optimizer=True)
    assert isinstance(saved, types.SaveResponse)
    assert saved.twinkle_path == str(saved) == "twinkle://run-1/weights/s"
    assert saved.checkpoint_dir is None
    progress = model.resume_from_checkpoint(saved)  # a SaveResponse stands for its path
    assert progress == {"cur_step": 2, "consumed_train_samples": 8}


def test_errors_and_upload_to_hub(model, fake):
    fake.fail[f"{M}/upload_to_hub"] = (404, "Not Found")
    with pytest.raises(twinkle_client.TwinkleError, match="not available on this server"):
        model.upload_to_hub(checkpoint_dir="twinkle://run-1/weights/s", hub_model_id="me/x")
    fake.fail[f"{M}/set_loss"] = (400, "loss_cls: unknown 'Nope'")
    with pytest.raises(twinkle_client.InvalidRequestError, match="unknown 'Nope'") as e:
        model.set_loss("Nope")
    assert e.value.status_code == 400
    with pytest.raises(twinkle_client.InvalidRequestError, match="callable"):
        model.set_lr_scheduler(lambda step: 1.0)


def test_close_removes_the_adapters_this_object_added(model, fake):
    model.add_adapter_to_model("second", {"r": 4})
    model.close()
    assert [c.body for c in fake.calls(f"{M}/remove_adapter")] == [
        {"adapter_name": "default"},
        {"adapter_name": "second"},
    ]


def test_sampler_routes_bodies_and_results(client, fake):
    sampler = vLLMSampler(model_id=f"ms://{MODEL}")
    assert fake.last(f"{S}/create").body == {}
    sampler.set_template("Qwen3_5Template", model_id=f"ms://{MODEL}")
    assert fake.last(f"{S}/set_template").body == {
        "template_cls": "Qwen3_5Template",
        "adapter_name": "",
        "model_id": f"ms://{MODEL}",
    }
    traj = {"messages": [{"role": "user", "content": "2+2?"}]}
    params = {"max_tokens": 8, "temperature": 1.0, "num_samples": 2, "logprobs": 1}
    out = sampler.sample(inputs=[traj], sampling_params=params, adapter_uri="twinkle://r/w/s")
    assert fake.last(f"{S}/sample").body == {
        "inputs": [traj],
        "sampling_params": params,
        "adapter_name": "",
        "num_samples": 1,
        "adapter_uri": "twinkle://r/w/s",
    }
    assert isinstance(out, list) and isinstance(out[0], types.SampleResponseModel)
    seq = out[0].sequences[1]
    assert seq.tokens == [51, 51, 2] and seq.stop_reason == "stop" and seq.decoded == "answer 1"
    assert seq.logprobs is not None and seq.logprobs[0][0] == [51, -0.1]
    assert seq.token_logprobs == pytest.approx([-0.1, -0.2, -0.3])
    assert seq.new_input_feature is not None and seq.new_input_feature["input_ids"][-3:] == [
        51,
        51,
        2,
    ]
    sampler.sample([traj])
    assert "adapter_uri" not in fake.last(f"{S}/sample").body  # only sent when given
    deltas = list(sampler.sample_stream(traj, {"max_tokens": 4}))
    assert "".join(d["delta"] for d in deltas) == "answer" and deltas[-1]["finish_reason"] == "stop"
    assert fake.last(f"{S}/sample_stream").body["inputs"] == [traj]
    torch_sampler = TorchSampler(MODEL)
    torch_sampler.add_adapter_to_sampler("a", {"r": 4})
    assert fake.last(f"{S}/add_adapter_to_sampler").body == {
        "adapter_name": "a",
        "config": {"r": 4},
    }


def test_management_objects(client, fake):
    caps = client.get_server_capabilities()
    assert [m.model_name for m in caps.supported_models] == [MODEL]
    runs = client.list_training_runs()
    assert fake.last("/training_runs").params == {"limit": "20", "offset": "0"}
    assert isinstance(runs[0], types.TrainingRun) and runs[0].training_run_id == "run-1"
    assert runs[0].model_owner == "alice" and '"base_model"' in runs[0].model_dump_json(indent=2)
    ckpts = client.list_checkpoints("run-1")
    assert isinstance(ckpts[0], types.Checkpoint)
    assert (ckpts[0].checkpoint_id, ckpts[0].checkpoint_type) == ("weights/step-2", "training")
    assert ckpts[0].size_bytes == 1234 and ckpts[0].time.year == 2026
    assert ckpts[0].twinkle_path == CKPT["twinkle_path"]
    assert client.get_training_run("run-1").base_model == MODEL
    assert client.get_latest_checkpoint_path("run-1") == CKPT["twinkle_path"]
    assert client.get_capacity_info().models is not None
    client.delete_checkpoint("run-1", "weights/step-2")
    assert fake.last("/checkpoint").params == {"path": "twinkle://run-1/weights/step-2"}


# -- upstream cookbook-style scripts (cookbook/client/twinkle/*.py), against our API ---------------
def _cookbook_self_cognition(tmp_path):
    client = init_twinkle_client(base_url=BASE_URL, api_key=API_KEY)
    for item in client.get_server_capabilities().supported_models:
        assert item.model_name
    resume_path = None
    for run in client.list_training_runs():
        run.model_dump_json(indent=2)
        for checkpoint in client.list_checkpoints(run.training_run_id):
            checkpoint.model_dump_json(indent=2)
            resume_path = checkpoint.twinkle_path
    data = tmp_path / "self_cognition.jsonl"
    rows = [{"query": f"q{i} {{{{NAME}}}}?", "response": "I am {{NAME}}"} for i in range(12)]
    data.write_text("\n".join(json.dumps(r) for r in rows))
    dataset = Dataset(dataset_meta=DatasetMeta(str(data), data_slice=range(10)))
    dataset.set_template("Qwen3_5Template", model_id=f"ms://{MODEL}", max_length=512)
    dataset.map("SelfCognitionProcessor", init_args={"model_name": "tw", "model_author": "ms"})
    dataset.encode(batched=True)
    dataloader = DataLoader(dataset=dataset, batch_size=4)
    model = MultiLoraTransformersModel(model_id=f"ms://{MODEL}")
    model.add_adapter_to_model(
        "default", {"target_modules": "all-linear"}, gradient_accumulation_steps=2
    )
    model.set_template("Qwen3_5Template")
    model.set_processor("InputProcessor", padding_side="right")
    model.set_loss("CrossEntropyLoss")
    model.set_optimizer("Adam", lr=1e-4)
    progress = model.resume_from_checkpoint(resume_path)
    dataloader.resume_from_checkpoint(progress["consumed_train_samples"])
    start_step = progress["cur_step"]
    model.get_train_configs().model_dump()
    metrics, saved = [], []
    for epoch in range(2):
        for cur_step, batch in enumerate(dataloader, start=start_step + 1):
            model.forward_backward(inputs=batch)
            model.clip_grad_and_step()
            if cur_step % 2 == 0:
                metrics.append(model.calculate_metric(is_training=True).result)
        saved.append(
            model.save(
                name=f"twinkle-epoch-{epoch}",
                save_optimizer=True,
                consumed_train_samples=dataloader.get_state()["consumed_train_samples"],
            )
        )
    client.close()
    return len(dataloader), metrics, saved


def test_cookbook_self_cognition(fake, tmp_path, monkeypatch):
    _fake_init(monkeypatch, fake)  # the cookbook passes no transport: inject the fake
    n_batches, metrics, saved = _cookbook_self_cognition(tmp_path)
    assert n_batches == 3 and metrics and metrics[0]["step"] == 1
    assert [str(s) for s in saved] == [
        "twinkle://run-1/weights/twinkle-epoch-0",
        "twinkle://run-1/weights/twinkle-epoch-1",
    ]
    fb = fake.calls(f"{M}/forward_backward")
    # resumed at 8 of 10 rows: epoch 0 has one batch of 2, epoch 1 all 3 batches
    assert [len(c.body["inputs"]) for c in fb] == [2, 4, 4, 2]
    row = fb[0].body["inputs"][0]
    assert {"messages", "input_ids", "labels", "attention_mask", "position_ids"} <= set(row)
    assert row["labels"][-1] == -100 and row["labels"][:-1] != row["input_ids"][1:]  # rolled
    trained = [i for i, lab in enumerate(row["labels"]) if lab != -100]
    assert all(row["labels"][i] == row["input_ids"][i + 1] for i in trained)  # target of i at i
    saves = fake.calls(f"{M}/save")
    assert (
        saves[0].body["consumed_train_samples"] == 10
        and saves[1].body["consumed_train_samples"] == 20
    )


def test_cookbook_dpo(client, fake):
    dataset = Dataset(
        dataset_meta=DatasetMeta(
            data=[{"prompt": f"p{i}", "chosen": "good", "rejected": "bad"} for i in range(4)]
        )
    )
    dataset.set_template("Qwen3_5Template", model_id=f"ms://{MODEL}", max_length=2048)
    dataset.map("DPOProcessor", init_args={"system": "You are a helpful assistant."})
    dataset.encode()
    model = MultiLoraTransformersModel(model_id=f"ms://{MODEL}")
    model.add_adapter_to_model("default", {"r": 8, "lora_alpha": 32}, gradient_accumulation_steps=2)
    model.set_template("Qwen3_5Template")
    model.set_processor("InputProcessor", padding_side="right")
    model.set_loss("DPOLoss", beta=0.1, loss_type="sigmoid", reference_free=False, sft_weight=1.0)
    model.add_metric("DPOMetric", beta=0.1)
    model.set_optimizer("Adam", lr=1e-4)
    for batch in DataLoader(dataset=dataset, batch_size=2):
        pairs = dpo_batch(batch)
        ref_outputs = model.forward_only(inputs=pairs, disable_lora=True)
        model.forward_backward(inputs=pairs, ref_outputs=ref_outputs.result)
        model.clip_grad_and_step()
    assert model.save(name="dpo-lora-final", save_optimizer=True).twinkle_path
    fo, fb = fake.calls(f"{M}/forward_only"), fake.calls(f"{M}/forward_backward")
    assert len(fo) == len(fb) == 2 and fo[0].body["disable_lora"] is True
    assert len(fb[0].body["inputs"]) == 4  # (chosen, rejected) x 2, interleaved
    assert fb[0].body["ref_outputs"]["logps"] and fb[0].body["inputs"][0]["labels"][-1] == -100
    assert fake.last("/add_metric").body == {
        "metric_cls": "DPOMetric",
        "is_training": None,
        "adapter_name": "default",
        "beta": 0.1,
    }


def test_cookbook_grpo_and_sample(client, fake):
    dataset = LazyDataset(
        dataset_meta=DatasetMeta(
            data=[{"question": f"{i}+1?", "answer": f"#### {i + 1}"} for i in range(4)]
        )
    )
    dataset.set_template("Qwen3_5Template", model_id=f"ms://{MODEL}", enable_thinking=False)
    dataset.map("GSM8KProcessor")
    dataset.encode(add_generation_prompt=True)
    assert not fake.calls("/api/v1/twinkle/encode")  # lazy: encoded on first read
    dataloader = DataLoader(dataset=dataset, batch_size=2, num_workers=0)
    model = MultiLoraTransformersModel(model_id=f"ms://{MODEL}")
    model.add_adapter_to_model("default", {"r": 8}, gradient_accumulation_steps=1)
    model.set_loss("GRPOLoss", epsilon=0.2, beta=0.0)
    model.set_optimizer("Adam", lr=2e-5)
    model.set_processor("InputProcessor")
    model.set_template("Qwen3_5Template", model_id=f"ms://{MODEL}")
    sampler = vLLMSampler(model_id=f"ms://{MODEL}")
    sampler.set_template("Qwen3_5Template", model_id=f"ms://{MODEL}")
    params = {"max_tokens": 16, "temperature": 1.0, "top_p": 0.95, "num_samples": 2, "logprobs": 1}
    for batch in dataloader:
        uri = model.save(name="grpo-sampler-weights", save_optimizer=False, is_sampler=True)
        responses = sampler.sample(
            inputs=batch, sampling_params=params, adapter_uri=uri.twinkle_path
        )
        data, old_logps = [], []
        for response in responses:
            for sequence in response.sequences:
                data.append(sequence.new_input_feature)
                old_logps.append([lp[0][1] for lp in sequence.logprobs or []])
        rewards = [float(len(d["messages"][-1]["content"]) + i % 2) for i, d in enumerate(data)]
        advantages = (np.array(rewards) - np.mean(rewards)).tolist()
        model.forward_backward(inputs=data, advantages=advantages, old_logps=old_logps)
        model.clip_grad_and_step()
        assert isinstance(model.calculate_metric(is_training=True).result, dict)
    encode = fake.last("/api/v1/twinkle/encode").body
    assert encode["add_generation_prompt"] is True
    assert encode["template"] == {
        "name": "Qwen3_5Template",
        "kwargs": {"truncation_strategy": "right", "enable_thinking": False},
    }
    sample = fake.calls(f"{S}/sample")
    assert len(sample) == 2 and sample[0].body["adapter_uri"].startswith("twinkle://")
    assert "input_ids" in sample[0].body["inputs"][0]  # encoded prompts go as features
    fb = fake.last(f"{M}/forward_backward").body
    assert len(fb["inputs"]) == 4 and len(fb["advantages"]) == 4
    assert fb["old_logps"][0] == pytest.approx([-0.1, -0.2, -0.3])

    # cookbook/client/twinkle/sample.py: trajectories in, tokens out
    trajectory = {
        "messages": [{"role": "system", "content": "hi"}, {"role": "user", "content": "who?"}]
    }
    responses = sampler.sample(
        inputs=[trajectory] * 4,
        sampling_params={"max_tokens": 128, "temperature": 1.0, "num_samples": 2},
        adapter_uri="twinkle://run-1/weights/twinkle-lora-0",
    )
    assert len(responses) == 4 and all(len(r.sequences) == 2 for r in responses)


def test_swap_in_venv_runs_upstream_imports_with_our_client():
    """With tests/compat/swap_venv.py's venv built (upstream twinkle-kit 0.5.1, our client in
    place of theirs): upstream's cookbook imports resolve to our client, a peft LoraConfig
    travels as upstream's JSON string, and upstream's own deserializer reads it back."""
    import subprocess
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    py = repo / ".cache" / "twinkle-kit-0.5.1-ours" / "bin" / "python"
    if not py.exists():
        pytest.skip("no swap venv: python tests/compat/swap_venv.py builds it")
    code = f"""
import json, sys
sys.path.insert(0, {str(repo)!r})
from peft import LoraConfig
from twinkle import init_twinkle_client
from twinkle_client.model import MultiLoraTransformersModel
from twinkle_client.sampler import vLLMSampler
import twinkle_client
assert "twinkle-kit-0.5.1-ours" in twinkle_client.__file__, twinkle_client.__file__
from tests.unit.client_protocol_helpers import API_KEY, BASE_URL, FakeServer
fake = FakeServer()
init_twinkle_client(base_url=BASE_URL, api_key=API_KEY, transport=fake.transport)
model = MultiLoraTransformersModel(model_id="ms://twinkle/tiny-chat")
lora = LoraConfig(target_modules="all-linear", r=8)
model.add_adapter_to_model("default", lora, gradient_accumulation_steps=2)
cfg = json.loads(fake.last("/add_adapter_to_model").body["config"])
assert cfg["_TWINKLE_TYPE_"] == "LoraConfig" and cfg["r"] == 8, cfg
sampler = vLLMSampler(model_id="ms://twinkle/tiny-chat")
out = sampler.sample(inputs=[{{"messages": [{{"role": "user", "content": "hi"}}]}}])
print(out[0].sequences[0].decoded)
"""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # the installed copy
    out = subprocess.run(
        [str(py), "-c", code], capture_output=True, text=True, timeout=300, env=env
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "answer 0"


def _fake_init(monkeypatch, fake):
    """init_twinkle_client() with no arguments (as scripts call it) reaches the fake."""
    monkeypatch.setenv("TWINKLE_SERVER_URL", BASE_URL)
    monkeypatch.setenv("TWINKLE_SERVER_TOKEN", API_KEY)
    monkeypatch.setattr(twinkle_client._client, "_current", None)
    orig = twinkle_client._client.TwinkleClient.__init__

    def with_fake(self, *a, **kw):
        orig(self, *a, **{**kw, "transport": fake.transport, "session_heartbeat_interval": None})

    monkeypatch.setattr(twinkle_client._client.TwinkleClient, "__init__", with_fake)


@pytest.mark.parametrize("name", ["self_cognition", "short_math_grpo"])
def test_our_cookbook_scripts_run_against_the_fake(fake, monkeypatch, name):
    import importlib.util
    from pathlib import Path

    _fake_init(monkeypatch, fake)
    path = Path(__file__).resolve().parents[2] / "cookbook/client/twinkle/self_host" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"cookbook_{name}", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    if name == "self_cognition":
        out = mod.main(max_steps=4, resume=None)
        assert out["losses"] == [1.25] * 4 and out["checkpoint"].startswith("twinkle://")
        assert fake.last(f"{M}/save").body["consumed_train_samples"] == 8
        again = mod.main(max_steps=6, resume=out["checkpoint"])  # the fake resumes at 8 rows
        assert len(again["losses"]) == 2
    else:
        out = mod.main(steps=2, generations=2, seed=0)
        assert len(out["steps"]) == 2 and out["steps"][0]["step"] == 1
        body = fake.last(f"{M}/forward_backward").body
        assert len(body["inputs"]) == len(body["advantages"]) == len(body["old_logps"]) == 4


def test_over_real_http_as_the_cookbook_calls_it(fake):
    """No transport injected: ``init_twinkle_client(base_url, api_key)`` against a local HTTP
    server wrapping the fake (headers with underscores included, as sent on the wire)."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    import httpx

    class Handler(BaseHTTPRequestHandler):
        def _serve(self):
            n = int(self.headers.get("content-length") or 0)
            req = httpx.Request(
                self.command,
                f"{BASE_URL}{self.path}",
                headers=list(self.headers.items()),
                content=self.rfile.read(n),
            )
            resp = fake.handle(req)
            self.send_response(resp.status_code)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(resp.content)))
            self.end_headers()
            self.wfile.write(resp.content)

        do_GET = do_POST = do_DELETE = _serve

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        client = init_twinkle_client(
            base_url=f"http://127.0.0.1:{server.server_address[1]}", api_key=API_KEY
        )
        model = MultiLoraTransformersModel(model_id=f"ms://{MODEL}")
        model.add_adapter_to_model("default", {"r": 8}, gradient_accumulation_steps=2)
        assert model.forward_backward(inputs=[{"input_ids": [1, 2]}]).result["loss"] == 1.25
        assert model.save(name="x").twinkle_path == "twinkle://run-1/weights/x"
        client.close()
    finally:
        server.shutdown()
        server.server_close()
    call = fake.last(f"{M}/forward_backward")
    assert call.headers["serve_multiplexed_model_id"] == REQUEST_ID
    assert call.headers["Serve-Multiplexed-Model-Id"] == REQUEST_ID
    assert call.headers["x-twinkle-session-id"] == "sess-1"
    assert call.headers["twinkle-authorization"] == f"Bearer {API_KEY}"


def test_client_multi_turn_rollout_with_tools(client, fake):
    """upstream's multi_turn_rollout cookbook: ClientMultiTurnRollout(sampler, template,
    tool_manager, sampling_params, max_turns) over HTTP; a tool turn is bridged, then the
    assistant answers; logprobs stay aligned with the trainable labels."""
    from twinkle_client.rollout import ClientMultiTurnRollout
    from twinkle_client.template import Qwen3_5Template

    calls = []

    class ToolTemplate(Qwen3_5Template):
        def parse_tool_call(self, text):  # the first answer of each trajectory calls a tool
            calls.append(text)
            return [{"name": "calc", "arguments": "{}"}] if len(calls) <= 2 else []

    def bridge(feature, tool_messages, template):
        assert template is tpl and tool_messages == [{"role": "tool", "content": "42"}]
        return {
            **feature,
            "input_ids": feature["input_ids"] + [9, 9],
            "labels": feature["labels"] + [-100, -100],
            "messages": [*feature["messages"], *tool_messages],
        }

    tpl = ToolTemplate(MODEL)
    sampler = vLLMSampler(model_id=MODEL)
    rollout = ClientMultiTurnRollout(
        sampler,
        tpl,
        tool_manager=lambda call: "42",
        sampling_params={"max_tokens": 8, "num_samples": 1, "logprobs": 1},
        max_turns=3,
        bridge=bridge,
    )
    trajs = [{"messages": [{"role": "user", "content": f"q{i}"}], "id": i} for i in range(2)]
    out = rollout(trajs)
    assert [o["id"] for o in out] == [0, 1] and [o["turns"] for o in out] == [2, 2]
    assert all(o["stop_reason"] == "stop" and not o["truncated"] for o in out)
    assert len(out[0]["logprobs"]) == 6 == sum(lab != -100 for lab in out[0]["labels"])
    assert [m["role"] for m in out[0]["messages"]][-3:] == ["assistant", "tool", "assistant"]
    second = fake.calls(f"{S}/sample")[1].body
    assert second["inputs"][0]["input_ids"][-5:] == [50, 51, 2, 9, 9]  # bridged, then resampled
    capped = ClientMultiTurnRollout(
        sampler, ToolTemplate(MODEL), tool_manager=lambda c: "42", max_turns=1, bridge=bridge
    )
    calls.clear()
    (one,) = capped(trajs[:1])
    assert one["truncated"] and one["stop_reason"] == "max_turns"
    with pytest.raises(ValueError, match="num_samples"):
        ClientMultiTurnRollout(sampler, tpl, sampling_params={"num_samples": 2})
