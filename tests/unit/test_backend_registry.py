"""engine/backends/registry.py: backends by name, lazy imports, config names, clear errors."""

from __future__ import annotations

import subprocess
import sys
from typing import get_args

import pytest

from engine.backends import registry
from engine.backends.registry import build_sampling_backend, build_training_backend
from engine.config import EngineConfig, ModelConfig
from engine.errors import ConfigError

TINY = "twinkle/tiny-chat"


def _unvalidated(**fields) -> ModelConfig:
    """A ModelConfig that skips validation, as a hand-built config object could."""
    base = ModelConfig(name=TINY).model_dump()
    return ModelConfig.model_construct(**{**base, **fields})


def test_names_match_the_config() -> None:
    assert list(registry.TRAINING_BACKENDS) == ["transformers", "megatron", "mock"]
    assert list(registry.SAMPLING_BACKENDS) == ["torch", "vllm", "mock"]
    fields = ModelConfig.model_fields
    assert set(get_args(fields["backend"].annotation)) == set(registry.TRAINING_BACKENDS)
    assert set(get_args(fields["sampler_type"].annotation)) == set(registry.SAMPLING_BACKENDS)
    # the defaults did not change
    m = ModelConfig(name=TINY)
    assert (m.backend, m.sampler_type) == ("transformers", "torch")


@pytest.mark.parametrize(
    ("build", "fields", "message"),
    [
        (
            build_training_backend,
            {"backend": "jax"},
            "unknown training backend 'jax'; known: megatron, mock, transformers",
        ),
        (
            build_sampling_backend,
            {"sampler_type": "tgi"},
            "unknown sampler_type 'tgi'; known: mock, torch, vllm",
        ),
    ],
)
def test_unknown_name_is_a_config_error_listing_the_known_ones(build, fields, message) -> None:
    with pytest.raises(ConfigError) as exc:
        build(_unvalidated(**fields), "/nonexistent")
    assert str(exc.value) == message


def test_config_rejects_unknown_names_listing_the_known_ones() -> None:
    for key, known in (
        ("backend", "'transformers', 'megatron' or 'mock'"),
        ("sampler_type", "'torch', 'vllm' or 'mock'"),
    ):
        with pytest.raises(ConfigError, match=rf"models\.0\.{key}: .*{known}"):
            EngineConfig.from_dict({"models": [{"name": TINY, key: "nope"}]})


def test_megatron_on_a_missing_model_is_a_config_error() -> None:
    cfg = ModelConfig(name="m", path="/nonexistent", backend="megatron")
    with pytest.raises(ConfigError, match="path ./nonexistent. does not exist"):
        build_training_backend(cfg, "/nonexistent")


def test_upstream_use_megatron_spelling() -> None:
    assert ModelConfig(name=TINY, use_megatron=True).backend == "megatron"
    assert ModelConfig(name=TINY, use_megatron=False).backend == "transformers"
    assert ModelConfig(name=TINY, use_megatron=False, backend="mock").backend == "mock"
    for bad in ({"use_megatron": True, "backend": "mock"}, {"use_megatron": "yes"}):
        with pytest.raises(ConfigError, match="use_megatron"):
            EngineConfig.from_dict({"models": [{"name": TINY, **bad}]})


def test_builds_the_real_backends_by_name(tiny_model_dir) -> None:
    from engine.backends.sample_torch import TorchSamplingBackend
    from engine.backends.train_transformers import TransformersTrainingBackend

    cfg = ModelConfig(name="tiny", path=str(tiny_model_dir), max_lora_rank=16)
    trainer = build_training_backend(cfg, "/nonexistent")
    assert isinstance(trainer, TransformersTrainingBackend) and trainer.max_lora_rank == 16
    assert isinstance(build_sampling_backend(cfg, "/nonexistent"), TorchSamplingBackend)


def test_builds_the_megatron_backend_by_name(tiny_model_dir) -> None:
    from engine.backends.megatron.backend import MegatronTrainingBackend

    cfg = ModelConfig(name="tiny", path=str(tiny_model_dir), use_megatron=True, max_lora_rank=16)
    trainer = build_training_backend(cfg, "/nonexistent")
    try:
        assert isinstance(trainer, MegatronTrainingBackend) and trainer.max_lora_rank == 16
    finally:
        trainer.close()


def test_building_mock_imports_no_torch() -> None:
    code = (
        "import sys\n"
        "from engine.backends.registry import build_sampling_backend, build_training_backend\n"
        "from engine.config import ModelConfig\n"
        "cfg = ModelConfig(name='twinkle/tiny-chat', backend='mock', sampler_type='mock',\n"
        "                  max_context_length=300)\n"
        "t, s = build_training_backend(cfg, '/x'), build_sampling_backend(cfg, '/x')\n"
        "assert (t.max_positions, s.max_positions) == (300, 300)\n"
        "print(sorted(m for m in ('torch', 'transformers', 'vllm') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_backends_compute_on_the_cores_they_are_given(tiny_model_dir, tmp_path) -> None:
    """torch_threads: as configured, else the cores the process may run on (not Ray's
    OMP_NUM_THREADS=1 of a replica with num_cpus < 2)."""
    import os

    import torch

    before = torch.get_num_threads()
    host = len(os.sched_getaffinity(0))
    try:
        torch.set_num_threads(1)  # as in a Ray replica with num_cpus 0.5
        m = ModelConfig(name="org/model", path=str(tiny_model_dir))
        build_training_backend(m, str(tmp_path))
        assert torch.get_num_threads() == host
        m = ModelConfig(name="org/model", path=str(tiny_model_dir), sampler={"torch_threads": 1})
        build_sampling_backend(m, str(tmp_path))
        assert torch.get_num_threads() == 1
        torch.set_num_threads(host)
        build_training_backend(ModelConfig(name=TINY), str(tmp_path))  # built in: 1 by default
        assert torch.get_num_threads() == 1
        with pytest.raises(ValueError, match="torch_threads"):
            ModelConfig(name=TINY, trainer={"torch_threads": 0})
    finally:
        torch.set_num_threads(before)
