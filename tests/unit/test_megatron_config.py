"""The ``megatron`` config section and the torch-free support check
(engine/backends/megatron/arch.py): every refusal names the field and the rule."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from engine.backends.megatron.arch import arch_from_hf_config, read_arch
from engine.config import EngineConfig, MegatronConfig, ModelConfig
from engine.errors import ConfigError

TINY = "twinkle/tiny-chat"

QWEN2 = {
    "architectures": ["Qwen2ForCausalLM"],
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 4,
    "intermediate_size": 128,
    "vocab_size": 512,
    "tie_word_embeddings": True,
    "rope_theta": 1000000.0,
}


def _load(model: dict) -> EngineConfig:
    return EngineConfig.from_dict({"models": [{"name": TINY, **model}]})


def test_use_megatron_with_a_megatron_section() -> None:
    cfg = _load({"use_megatron": True, "megatron": {"tensor_parallel": 2, "pipeline_parallel": 2}})
    m = cfg.models[0]
    assert m.backend == "megatron"
    mc = m.megatron_config()
    assert (mc.tensor_parallel, mc.pipeline_parallel, mc.params_dtype) == (2, 2, "float32")
    # upstream's spelling backend: megatron is the same thing; defaults: one rank on CPU
    d = _load({"backend": "megatron"}).models[0].megatron_config()
    assert d == MegatronConfig() and (d.tensor_parallel, d.worker_num_gpus) == (1, 0)


@pytest.mark.parametrize(
    ("model", "message"),
    [
        ({"megatron": {"tensor_parallel": 2}}, "a 'megatron' section needs backend megatron"),
        ({"use_megatron": True, "megatron": {"tensor_parallel": 0}}, r"megatron\.tensor_parallel"),
        ({"use_megatron": True, "megatron": {"tp": 2}}, r"megatron\.tp: Extra inputs"),
        (
            {"use_megatron": True, "megatron": {"sequence_parallel": True, "tensor_parallel": 2}},
            "sequence_parallel needs GPUs",
        ),
        (
            {"use_megatron": True, "megatron": {"sequence_parallel": True, "worker_num_gpus": 1}},
            "sequence_parallel is not supported by the multi-LoRA hooks",
        ),
        (
            {"use_megatron": True, "megatron": {"recompute_granularity": "full"}},
            "recompute_granularity: full is not supported",
        ),
        (
            {"use_megatron": True, "megatron": {"params_dtype": "bfloat16"}},
            "params_dtype bfloat16 needs GPUs",
        ),
        ({"use_megatron": True, "megatron": {"worker_num_gpus": 2}}, r"megatron\.worker_num_gpus"),
    ],
)
def test_bad_sections_name_the_field(model: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        _load(model)


def test_gpu_settings_are_accepted_with_gpus() -> None:
    mc = (
        _load(
            {
                "use_megatron": True,
                "megatron": {
                    "tensor_parallel": 2,
                    "params_dtype": "bfloat16",
                    "worker_num_gpus": 1,
                    "recompute_granularity": "selective",
                },
            }
        )
        .models[0]
        .megatron_config()
    )
    assert mc.params_dtype == "bfloat16" and mc.recompute_granularity == "selective"


def test_arch_reads_the_supported_families() -> None:
    a = arch_from_hf_config(QWEN2, tp=2, pp=2)
    assert (a.family, a.num_kv_groups, a.head_dim, a.tied, a.qkv_bias, a.qk_norm) == (
        "qwen2",
        2,
        16,
        True,
        True,
        False,
    )
    q3 = arch_from_hf_config({**QWEN2, "architectures": ["Qwen3ForCausalLM"], "head_dim": 32})
    assert (q3.family, q3.qk_norm, q3.qkv_bias, q3.head_dim) == ("qwen3", True, False, 32)
    llama = {
        **QWEN2,
        "architectures": ["LlamaForCausalLM"],
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    }
    la = arch_from_hf_config(llama)
    assert (la.family, la.qkv_bias, la.rope_scaling_factor) == ("llama", False, 8.0)


@pytest.mark.parametrize(
    ("change", "tp", "pp", "message"),
    [
        ({"architectures": ["MixtralForCausalLM"]}, 1, 1, "architectures .* not supported"),
        ({"use_sliding_window": True}, 1, 1, "use_sliding_window"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, 1, 1, "rope_type 'yarn'"),
        (
            {
                "architectures": ["LlamaForCausalLM"],
                "rope_scaling": {
                    "rope_type": "llama3",
                    "factor": 8.0,
                    "low_freq_factor": 2.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 8192,
                },
            },
            1,
            1,
            "rope_scaling.low_freq_factor 2.0 must be 1",
        ),
        ({"hidden_act": "gelu"}, 1, 1, "hidden_act 'gelu' must be 'silu'"),
        ({}, 4, 1, "tensor_parallel 4 must divide num_key_value_heads 2"),
        ({"num_key_value_heads": 4, "vocab_size": 510}, 4, 1, "must divide vocab_size 510"),
        ({}, 1, 3, "pipeline_parallel 3 must divide num_hidden_layers 4"),
        ({"hidden_size": None}, 1, 1, "hidden_size is missing"),
    ],
)
def test_arch_refusals_name_the_field(change: dict, tp: int, pp: int, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        arch_from_hf_config({**QWEN2, **change}, tp=tp, pp=pp)


def test_read_arch_errors_on_a_missing_config(tmp_path) -> None:
    with pytest.raises(ConfigError, match="cannot read .*config.json"):
        read_arch(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(QWEN2))
    assert read_arch(tmp_path, tp=2).vocab_size == 512


def test_config_and_arch_import_no_torch() -> None:
    code = (
        "import sys\n"
        "import engine.backends.megatron.arch, engine.config\n"
        "from engine.config import ModelConfig\n"
        "ModelConfig(name='twinkle/tiny-chat', use_megatron=True,\n"
        "            megatron={'tensor_parallel': 2})\n"
        "print(sorted(m for m in ('torch', 'megatron') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_model_config_default_is_transformers() -> None:
    assert ModelConfig(name=TINY).megatron_config() == MegatronConfig()
