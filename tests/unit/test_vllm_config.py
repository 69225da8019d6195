"""`sampler_type: vllm` configuration without a vLLM engine: the config accepts torch and vllm
only, importing the vLLM backend module never imports vllm, and a missing vllm package is a clear
error (the vLLM sampler itself: test_vllm_sampler.py)."""

from __future__ import annotations

import importlib.util

import pytest

from engine.errors import ConfigError

HAVE_VLLM = importlib.util.find_spec("vllm") is not None


@pytest.mark.skipif(HAVE_VLLM, reason="checks the error when vllm is missing")
def test_vllm_sampler_type_without_vllm_is_a_clear_error(tiny_model_dir) -> None:
    from engine.backends.registry import build_sampling_backend
    from engine.config import ModelConfig

    cfg = ModelConfig(name="tiny", path=str(tiny_model_dir), sampler_type="vllm")
    with pytest.raises(ConfigError, match=r"sampler_type 'vllm' needs the vllm package"):
        build_sampling_backend(cfg, "/nonexistent")


def test_sampler_type_config_and_lazy_import() -> None:
    """`sampler_type` accepts torch and vllm only; importing the backend module (or the Sampler)
    never imports vllm, so the main venv, which has none, can load the engine."""
    import subprocess
    import sys

    from gateway.config import ServerConfig

    ok = ServerConfig.from_dict(
        {
            "models": [
                {
                    "name": "twinkle/tiny-chat",
                    "sampler_type": "vllm",
                    "vllm_engine_args": {"max_loras": 4},
                }
            ]
        }
    )
    assert ok.models[0].sampler_type == "vllm" and ok.models[0].vllm_engine_args == {"max_loras": 4}
    assert ServerConfig.from_dict({}).models[0].sampler_type == "torch"
    with pytest.raises(ConfigError, match=r"models\.0\.sampler_type"):
        ServerConfig.from_dict({"models": [{"name": "twinkle/tiny-chat", "sampler_type": "tgi"}]})
    code = "import sys, engine.sampler, engine.backends.sample_vllm; print('vllm' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
