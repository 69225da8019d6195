"""engine/backends/placement.py: a model's ``dtype`` and a replica's GPU reach the torch backends.

On CPU: ``auto`` is float32, ``bfloat16`` trains a float32 adapter on a bfloat16 base with the
float32 run's loss and gradients (to bf16 precision), its checkpoints load into a float32 backend
unchanged, and a replica that reserves a GPU it cannot see fails naming the field. The CUDA test
(marked gpu) trains on the GPU and moves the checkpoint to CPU.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.backends.lora import adapter_parameters
from engine.backends.placement import resolve_placement
from engine.backends.registry import build_sampling_backend, build_training_backend
from engine.backends.sample_torch import TorchSamplingBackend
from engine.backends.train_transformers import TransformersTrainingBackend
from engine.config import ModelConfig
from engine.errors import ConfigError
from engine.protocol import AdamParams, LoraSpec, SampleInput, SamplingParams
from tests.factories import random_batch

TINY = "twinkle/tiny-chat"
HAS_CUDA = torch.cuda.is_available()


def _trained(be: TransformersTrainingBackend) -> tuple[float, torch.Tensor, float]:
    """One step of adapter "a" (seeded, with a non-zero B): loss, its gradient, grad norm."""
    be.create_adapter("a", LoraSpec(rank=8, alpha=16.0, seed=3))
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in adapter_parameters(be.model, "a").items():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    out = be.forward_backward("a", random_batch(0, 4, 16))
    grad = torch.cat([p.grad.flatten().cpu() for p in adapter_parameters(be.model, "a").values()])
    norm = be.optim_step("a", AdamParams(learning_rate=1e-3)).metrics["grad_norm"]
    return out.metrics["loss:sum"], grad, norm


def test_auto_is_float32_on_cpu_and_names_are_checked() -> None:
    assert resolve_placement(0, "auto", "m") == (torch.device("cpu"), torch.float32)
    assert resolve_placement(0, "bfloat16", "m") == (torch.device("cpu"), torch.bfloat16)
    with pytest.raises(ConfigError, match=r"m: dtype 'float16' is not one of auto, float32"):
        resolve_placement(0, "float16", "m")
    with pytest.raises(ValueError, match="dtype"):
        ModelConfig(name=TINY, dtype="float16")  # type: ignore[arg-type]


@pytest.mark.skipif(HAS_CUDA, reason="needs a host without CUDA")
def test_a_gpu_replica_without_cuda_fails_naming_the_field(tmp_path: Path) -> None:
    builds = ((build_training_backend, "trainer"), (build_sampling_backend, "sampler"))
    for build, section in builds:
        model = ModelConfig(name=TINY, **{section: {"num_gpus": 1}})
        with pytest.raises(ConfigError) as exc:
            build(model, str(tmp_path))
        msg = str(exc.value)
        assert f"models[{TINY}].{section}.num_gpus is 1, but this replica sees no CUDA" in msg
        assert "set num_gpus: 0" in msg


def test_bfloat16_base_trains_a_float32_adapter_like_float32(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    fp32 = TransformersTrainingBackend(str(tiny_model_dir))
    bf16 = build_training_backend(
        ModelConfig(name=TINY, path=str(tiny_model_dir), dtype="bfloat16"), str(tmp_path)
    )
    assert isinstance(bf16, TransformersTrainingBackend)
    base = bf16.model.get_input_embeddings().weight
    assert base.dtype == torch.bfloat16 and fp32.model.get_input_embeddings().weight.dtype == (
        torch.float32
    )
    loss32, grad32, norm32 = _trained(fp32)
    loss16, grad16, norm16 = _trained(bf16)
    assert {p.dtype for p in adapter_parameters(bf16.model, "a").values()} == {torch.float32}
    assert loss16 == pytest.approx(loss32, rel=1e-3)
    assert torch.nn.functional.cosine_similarity(grad16, grad32, dim=0) > 0.999
    assert norm16 == pytest.approx(norm32, rel=2e-2)
    # the checkpoint is float32 whatever the base's dtype: a float32 backend loads it unchanged
    bf16.save_state("a", str(tmp_path / "ckpt"), include_optimizer=True)
    fp32.load_state("b", str(tmp_path / "ckpt"), include_optimizer=True)
    saved = adapter_parameters(bf16.model, "a")
    for name, p in adapter_parameters(fp32.model, "b").items():
        assert torch.equal(p, saved[name])


def test_torch_sampler_in_bfloat16_agrees_with_float32(tiny_model_dir: Path) -> None:
    outs = []
    for dtype in (torch.float32, torch.bfloat16):
        s = TorchSamplingBackend(str(tiny_model_dir), dtype=dtype)
        assert s.model.get_input_embeddings().weight.dtype == dtype
        prompt = s.tokenizer("User: what is 12 plus 13? Assistant:")["input_ids"]
        outs.append(
            s.sample(
                SampleInput(
                    prompt_tokens=prompt,
                    params=SamplingParams(max_tokens=6, temperature=0.0),
                    prompt_logprobs=True,
                )
            )
        )
    (a, b) = outs
    assert a.sequences[0].tokens == b.sequences[0].tokens
    lp32 = torch.tensor(a.prompt_logprobs[1:])
    lp16 = torch.tensor(b.prompt_logprobs[1:])
    assert torch.allclose(lp16, lp32, atol=0.05)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
def test_gpu_replica_trains_on_cuda_in_bfloat16(tiny_model_dir: Path, tmp_path: Path) -> None:
    model = ModelConfig(name=TINY, path=str(tiny_model_dir), trainer={"num_gpus": 1})
    be = build_training_backend(model, str(tmp_path))
    assert isinstance(be, TransformersTrainingBackend)
    assert be.device.type == "cuda"
    assert be.model.get_input_embeddings().weight.dtype == torch.bfloat16  # auto on a GPU
    loss, _, _ = _trained(be)
    loss32, _, _ = _trained(TransformersTrainingBackend(str(tiny_model_dir)))
    assert loss == pytest.approx(loss32, rel=1e-2)
    be.save_state("a", str(tmp_path / "ckpt"), include_optimizer=True)
    cpu = TransformersTrainingBackend(str(tiny_model_dir))
    cpu.load_state("a", str(tmp_path / "ckpt"), include_optimizer=True)
    # the optimizer state came to CPU with it: a step runs there
    cpu.forward_backward("a", random_batch(1, 2, 8))
    cpu.optim_step("a", AdamParams(learning_rate=1e-3))
