"""Engine metrics on a real Trainer and Sampler (tiny model, in-process): each replica serves its
Prometheus exposition on its own port and lists itself in the data dir's file_sd folder; the
series count the work that ran (tokens, latency, queue wait, failures by category, adapters
offloaded and reloaded, execution mode) with only model / replica / role and fixed-set labels;
closing removes the target; telemetry off serves nothing."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine.config import ModelConfig
from engine.errors import AdapterNotFoundError, UserInputError
from engine.protocol import AdamParams, ForwardBackwardInput, LoraSpec, SampleInput, SamplingParams
from engine.sampler import Sampler
from engine.telemetry.exporter import clear_targets, targets_dir
from engine.telemetry.metrics import failure_category
from engine.trainer import Trainer
from tests.factories import random_batch

FIXED = {"op", "kind", "category", "state", "mode", "le"}


def _scrape(target_file) -> dict[tuple[str, frozenset], float]:
    (target,) = json.loads(target_file.read_text())[0]["targets"]
    text = httpx.get(f"http://{target}/metrics", timeout=5).text
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


def _value(samples, name: str, **labels: str) -> float:
    """Sum of the samples of ``name`` whose labels include ``labels``."""
    want = set(labels.items())
    return sum(v for (n, lab), v in samples.items() if n == name and want <= lab)


def test_trainer_metrics_count_the_work_and_carry_no_tenant_labels(tiny_model_dir, tmp_path):
    cfg = ModelConfig(
        name="twinkle/tiny-chat",
        path=str(tiny_model_dir),
        execution="sequential",
        max_loaded_adapters=1,  # the second adapter offloads the first: offload + reload
    )
    tel = {"replica": "trainer-tiny-r0", "host": "127.0.0.1"}
    trainer = Trainer(cfg, str(tmp_path), telemetry=tel)
    target = targets_dir(tmp_path) / "trainer-tiny-r0.json"
    assert target.is_file()
    ids = ["run-secret-a", "run-secret-b"]

    async def work():
        for i, a in enumerate(ids):
            await trainer.create_adapter(a, LoraSpec(rank=4, seed=i), tenant=f"org-secret-{i}")
        for a in ids:  # "a" was offloaded when "b" was created: this reloads it
            await trainer.forward_backward(a, 1, random_batch(1, n=3, length=10))
            await trainer.optim_step(a, 2, AdamParams(learning_rate=1e-3))
        fwd = random_batch(3, n=2, length=5)
        await trainer.forward_backward(
            ids[0], 3, ForwardBackwardInput(data=fwd.data, forward_only=True)
        )
        with pytest.raises(AdapterNotFoundError):
            await trainer.forward_backward("run-secret-gone", 1, random_batch(2, n=1, length=4))

    asyncio.run(work())
    s = _scrape(target)
    ids_labels = {"model": "twinkle/tiny-chat", "replica": "trainer-tiny-r0", "role": "trainer"}
    assert _value(s, "twinkle_engine_tokens_total", kind="trained", **ids_labels) == 2 * 3 * 10
    assert _value(s, "twinkle_engine_tokens_total", kind="forward") == 2 * 5
    assert _value(s, "twinkle_engine_request_seconds_count", op="forward_backward") == 3
    assert _value(s, "twinkle_engine_request_seconds_count", op="forward") == 1
    assert _value(s, "twinkle_engine_request_seconds_count", op="optim_step") == 2
    assert _value(s, "twinkle_engine_request_seconds_count", op="create_adapter") == 2
    assert _value(s, "twinkle_engine_failed_requests_total", category="adapter_not_found") == 1
    assert _value(s, "twinkle_engine_failed_requests_total") == 1
    # every compute job waited in the queue once: 2 creates, 3 fwd/bwd, 2 steps, 1 forward
    assert _value(s, "twinkle_engine_queue_wait_seconds_count") == 8
    assert _value(s, "twinkle_engine_adapter_offloads_total") >= 1
    assert _value(s, "twinkle_engine_adapter_reloads_total") >= 1
    assert _value(s, "twinkle_engine_adapters", state="resident") == 1
    assert _value(s, "twinkle_trainer_execution_mode", mode="sequential") == 1
    assert _value(s, "twinkle_trainer_execution_mode", mode="fused") == 0
    assert _value(s, "twinkle_trainer_tenants") == 2
    assert _value(s, "twinkle_engine_queue_depth") == 0
    assert _value(s, "twinkle_engine_process_resident_bytes") > 10e6
    for (_, labels), _v in s.items():
        for k, v in labels:
            assert k in FIXED or k in ids_labels and v == ids_labels[k], (k, v)
            assert "secret" not in v
    (addr,) = json.loads(target.read_text())[0]["targets"]
    trainer.__del__()  # what Ray Serve calls on a replica's shutdown
    assert not target.exists()
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"http://{addr}/metrics", timeout=2)


def test_sampler_metrics_and_telemetry_off(tiny_model_dir, tmp_path):
    cfg = ModelConfig(name="twinkle/tiny-chat", path=str(tiny_model_dir))
    sampler = Sampler(cfg, str(tmp_path), telemetry={"replica": "sampler-tiny-r0"})
    target = targets_dir(tmp_path) / "sampler-tiny-r0.json"
    params = SamplingParams(max_tokens=5, temperature=1.0, seed=1)

    async def work():
        outs = await asyncio.gather(
            *(
                sampler.sample(SampleInput([1, 2, 3], num_samples=2, params=params))
                for _ in range(3)
            )
        )
        with pytest.raises(Exception):  # noqa: B017 - a missing adapter dir: CheckpointError
            await sampler.sample(SampleInput([1, 2], adapter_dir=str(tmp_path / "nope")))
        return outs

    outs = asyncio.run(work())
    s = _scrape(target)
    sampled = sum(len(q.tokens) for o in outs for q in o.sequences)
    assert _value(s, "twinkle_engine_tokens_total", kind="sampled", role="sampler") == sampled
    assert _value(s, "twinkle_engine_tokens_total", kind="prefilled") == 3 * 3
    assert _value(s, "twinkle_engine_request_seconds_count", op="sample") == 4
    assert _value(s, "twinkle_engine_failed_requests_total", category="checkpoint") == 1
    assert _value(s, "twinkle_engine_queue_wait_seconds_count") == 4
    assert _value(s, "twinkle_sampler_batches_total") >= 1
    assert _value(s, "twinkle_engine_adapters", state="loaded") == 0
    (addr,) = json.loads(target.read_text())[0]["targets"]
    sampler.close()
    assert not target.exists()
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"http://{addr}/metrics", timeout=2)

    clear_targets(tmp_path)
    off = Sampler(cfg, str(tmp_path))
    assert off.metrics is None and not targets_dir(tmp_path).exists()
    off.close()


def test_failure_categories_are_a_fixed_set():
    from engine.errors import BackendError, CheckpointError

    assert failure_category(UserInputError("x")) == "user_input"
    assert failure_category(AdapterNotFoundError("x")) == "adapter_not_found"
    assert failure_category(CheckpointError("x")) == "checkpoint"
    assert failure_category(BackendError("x")) == "backend"
    assert failure_category(RuntimeError("secret detail")) == "internal"
