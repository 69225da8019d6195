"""The execution probe's stored answers: a restart on the same kind of host reuses them, anything
that could change the answer measures again, and a broken cache never stops a Trainer."""

from __future__ import annotations

import json
import logging
import os
import time

import pytest
import torch

from engine.backends.train_transformers import TransformersTrainingBackend
from engine.config import ModelConfig
from engine.scheduling import execution_probe
from engine.scheduling.probe_cache import FOLDER, ProbeCache
from engine.trainer import Trainer

COSTS = {"fused_s": 0.2, "sequential_s": 0.1, "fused_speedup": 0.5, "choice": "sequential"}
FP = {"backend": "transformers", "device": "cpu", "name": "x", "threads": 2}
SHAPE = {"n_adapters": 4, "batch": 4, "seq_len": 128, "repeats": 3}


def test_round_trip_and_what_changes_the_key(tmp_path):
    cache = ProbeCache(tmp_path)
    key = cache.key(FP, SHAPE)
    assert cache.get(key) is None
    path = cache.put(key, {**COSTS, "extra": 1})
    assert path is not None and path.parent == tmp_path / FOLDER
    got = cache.get(key)
    assert got is not None
    assert {k: got[k] for k in COSTS} == COSTS and "extra" not in got
    assert got["stored"] is True and abs(got["measured_at"] - time.time()) < 60
    assert str(tmp_path) not in json.dumps(got)  # no server path in what stats show
    # each part of the key is part of the answer: threads, shape, the probe's version
    assert cache.get(cache.key({**FP, "threads": 1}, SHAPE)) is None
    assert cache.get(cache.key(FP, {**SHAPE, "batch": 1})) is None
    assert cache.get({**key, "version": key["version"] + 1}) is None
    assert [p.name for p in (tmp_path / FOLDER).iterdir()] == [path.name]  # no temp file left


def test_old_broken_or_foreign_entries_are_ignored(tmp_path, caplog):
    cache = ProbeCache(tmp_path, max_age_s=3600)
    key = cache.key(FP, SHAPE)
    path = cache.put(key, COSTS)
    assert path is not None
    entry = json.loads(path.read_text())

    def write(**changes):
        path.write_text(json.dumps({**entry, **changes}))

    write(measured_at=time.time() - 7200)  # older than max_age_s
    assert cache.get(key) is None
    write(measured_at=time.time() + 7200)  # from the future: a clock that jumped
    assert cache.get(key) is None
    write(key={**key, "shape": {}})  # another key's answer under this name
    assert cache.get(key) is None
    write(costs={**COSTS, "choice": "fastest"})
    assert cache.get(key) is None
    with caplog.at_level(logging.WARNING):
        path.write_text('{"key": ')  # half a file
        assert cache.get(key) is None
    assert "unreadable" in caplog.text
    write()
    assert cache.get(key) is not None


def test_an_unwritable_data_dir_loses_only_the_cache(tmp_path, caplog):
    (tmp_path / FOLDER).write_text("a file where the folder should be")
    cache = ProbeCache(tmp_path)
    with caplog.at_level(logging.WARNING):
        assert cache.put(cache.key(FP, SHAPE), COSTS) is None
    assert "could not write" in caplog.text
    assert cache.get(cache.key(FP, SHAPE)) is None


def _cfg(model_dir, **kw) -> ModelConfig:
    return ModelConfig(name="twinkle/tiny-chat", path=str(model_dir), execution="auto", **kw)


def test_a_restarted_trainer_reuses_the_measurement(tiny_model_dir, tmp_path, monkeypatch):
    runs = []
    real = execution_probe.measure_execution_costs

    def counted(*args, **kwargs):
        runs.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(execution_probe, "measure_execution_costs", counted)
    first = Trainer(_cfg(tiny_model_dir), str(tmp_path))
    assert len(runs) == 1 and "stored" not in first.execution
    again = Trainer(_cfg(tiny_model_dir), str(tmp_path))
    assert len(runs) == 1, "the second start measured again"
    assert again.execution["mode"] == first.execution["mode"]
    assert again.execution["fused_s"] == first.execution["fused_s"]
    assert again.execution["stored"] is True
    # another probe shape (a smaller slice) is another question
    Trainer(_cfg(tiny_model_dir, slice_tokens=128), str(tmp_path))
    assert len(runs) == 2 and runs[1]["batch"] == 1
    # another data dir knows nothing
    Trainer(_cfg(tiny_model_dir), str(tmp_path / "other"))
    assert len(runs) == 3


def test_the_fingerprint_names_what_the_timing_ran_on(tiny_model_dir):
    threads = torch.get_num_threads()
    be = TransformersTrainingBackend(str(tiny_model_dir))
    fp = be.device_fingerprint()
    assert json.loads(json.dumps(fp)) == fp
    assert fp["backend"] == "transformers" and fp["device"] == "cpu" and fp["dtype"] == "float32"
    assert fp["name"] and fp["torch"] == torch.__version__ and fp["threads"] == threads
    assert TransformersTrainingBackend(str(tiny_model_dir)).device_fingerprint() == fp
    other = 1 if threads != 1 else 2
    torch.set_num_threads(other)
    try:
        assert be.device_fingerprint()["threads"] == other
    finally:
        torch.set_num_threads(threads)


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="Linux: cores from affinity")
def test_the_fingerprint_counts_the_cores_this_process_may_use(tiny_model_dir):
    be = TransformersTrainingBackend(str(tiny_model_dir))
    assert be.device_fingerprint()["cores"] == len(os.sched_getaffinity(0))


def test_a_megatron_trainer_reuses_its_own_measurement(tiny_model_dir, tmp_path, monkeypatch):
    """The Megatron backend gives its own fingerprint (its split and micro-batch size added), so
    its answer is stored apart from the Transformers backend's on the same model."""
    pytest.importorskip("megatron.core")
    runs = []
    real = execution_probe.measure_execution_costs
    monkeypatch.setattr(
        execution_probe,
        "measure_execution_costs",
        lambda *a, **kw: runs.append(kw) or real(*a, **kw),
    )
    first = Trainer(_cfg(tiny_model_dir, backend="megatron"), str(tmp_path))
    fp = first.backend.device_fingerprint()
    assert fp["backend"] == "megatron" and json.loads(json.dumps(fp)) == fp
    again = Trainer(_cfg(tiny_model_dir, backend="megatron"), str(tmp_path))
    assert len(runs) == 1 and again.execution["mode"] == first.execution["mode"]
    Trainer(_cfg(tiny_model_dir), str(tmp_path))  # transformers: another answer
    assert len(runs) == 2
    assert len(list((tmp_path / FOLDER).glob("*.json"))) == 2
