"""The backend ABCs are the whole contract: every concrete backend implements them, and the engine
calls nothing on a backend that the ABCs do not declare (no probes, no reach-in to its model)."""

from __future__ import annotations

import ast
import inspect
import math
from pathlib import Path

import pytest

from engine.backends.base import SamplingBackend, TrainingBackend
from engine.errors import BackendError, EngineError, UserInputError
from engine.protocol import SampleInput, SampleOutput

ROOT = Path(__file__).resolve().parents[2]
#: the engine modules that drive backends (everything outside engine/backends that holds one)
CALLERS = (
    "engine/trainer.py",
    "engine/sampler.py",
    "engine/scheduling/adapter_pool.py",
    "engine/scheduling/execution_probe.py",
    "engine/local/model.py",
)


def _concrete() -> list[tuple[type, type]]:
    from engine.backends.mock import MockTrainingBackend
    from engine.backends.mock_sampling import MockSamplingBackend
    from engine.backends.sample_torch import TorchSamplingBackend
    from engine.backends.sample_vllm import VllmSamplingBackend  # vllm itself is imported lazily
    from engine.backends.train_transformers import TransformersTrainingBackend

    return [
        (TrainingBackend, TransformersTrainingBackend),
        (TrainingBackend, MockTrainingBackend),
        (SamplingBackend, TorchSamplingBackend),
        (SamplingBackend, VllmSamplingBackend),
        (SamplingBackend, MockSamplingBackend),
    ]


@pytest.mark.parametrize(("abc", "cls"), _concrete(), ids=lambda c: c.__name__)
def test_every_abstract_method_is_implemented(abc, cls) -> None:
    assert issubclass(cls, abc)
    assert not cls.__abstractmethods__, f"{cls.__name__} leaves {set(cls.__abstractmethods__)}"


@pytest.mark.parametrize(("abc", "cls"), _concrete(), ids=lambda c: c.__name__)
def test_overrides_accept_the_contract_parameters(abc, cls) -> None:
    """An override may add keyword options but must take every parameter the ABC declares."""
    for name, member in vars(abc).items():
        if name.startswith("_") or not callable(member):
            continue
        impl = getattr(cls, name)
        want = list(inspect.signature(member).parameters)
        have = list(inspect.signature(impl).parameters)
        assert have[: len(want)] == want, f"{cls.__name__}.{name}{have} vs {want}"


def _backend_uses(path: str) -> set[str]:
    """Attribute names used on ``self.backend`` / ``backend`` in one engine module."""
    names: set[str] = set()
    for node in ast.walk(ast.parse((ROOT / path).read_text())):
        if not isinstance(node, ast.Attribute):
            continue
        v = node.value
        if (isinstance(v, ast.Name) and v.id == "backend") or (
            isinstance(v, ast.Attribute) and v.attr == "backend"
        ):
            names.add(node.attr)
    return names


@pytest.mark.parametrize("path", CALLERS)
def test_engine_calls_only_what_the_contract_declares(path) -> None:
    declared = set(dir(TrainingBackend)) | set(dir(SamplingBackend))
    declared |= set(TrainingBackend.__annotations__) | set(SamplingBackend.__annotations__)
    used = _backend_uses(path)
    assert used, f"{path} drives no backend? (update CALLERS)"
    assert used <= declared, f"{path} uses {sorted(used - declared)} outside the contract"
    text = (ROOT / path).read_text()
    for probe in ("getattr(self.backend", "getattr(backend", "inspect.signature"):
        assert probe not in text, f"{path} probes the backend: {probe}"
    assert "adapter_parameters" not in text and "backend.model" not in text


# ---------------------------------------------------------------------------- documented defaults


class _MinimalTraining(TrainingBackend):
    vocab_size, max_lora_rank = 10, 8

    def create_adapter(self, adapter_id, spec):
        pass

    def has_adapter(self, adapter_id):
        return False

    def delete_adapter(self, adapter_id):
        pass

    def adapter_spec(self, adapter_id):
        raise NotImplementedError

    def forward_backward(self, adapter_id, inp):
        raise UserInputError(f"bad {adapter_id}")

    def optim_step(self, adapter_id, params):
        raise NotImplementedError

    def save_state(self, adapter_id, directory, *, include_optimizer):
        return 0

    def load_state(self, adapter_id, directory, *, include_optimizer):
        raise NotImplementedError


class _MinimalSampling(SamplingBackend):
    vocab_size = 10

    def sample(self, inp):
        if not inp.prompt_tokens:
            raise UserInputError("prompt: empty")
        return SampleOutput(sequences=[])


def test_training_defaults() -> None:
    be = _MinimalTraining()
    assert be.max_positions is None
    assert be.validate_input(None) is None  # no check by default
    assert be.synchronize() is None
    assert be.adapter_grad("a", "norm") is None  # unknown without gradient access
    with pytest.raises(BackendError, match="cannot drop"):
        be.adapter_grad("a", "zero")
    with pytest.raises(UserInputError, match="unknown op 'clip'"):
        be.adapter_grad("a", "clip")
    with pytest.raises(NotImplementedError):
        be.has_pending_grad("a")
    out = be.forward_backward_many([("a", None), ("b", None)])
    assert [str(e) for e in out] == ["bad a", "bad b"]
    with pytest.raises(ValueError, match="more than once"):
        be.forward_backward_many([("a", None), ("a", None)])


def test_sampling_defaults() -> None:
    be = _MinimalSampling()
    assert be.tokenizer is None and be.max_positions is None
    calls: list = []
    out = be.sample_many([SampleInput([1]), SampleInput([])], [lambda *a: calls.append(a), None])
    assert isinstance(out[0], SampleOutput) and isinstance(out[1], EngineError)
    assert calls == []  # the default cannot stream: listeners are never called
    assert be.close() is None


def test_grad_norm_matches_on_mock_and_transformers(tiny_model_dir) -> None:
    """adapter_grad is the one gradient access the engine has; both backends agree on its
    semantics (norm of the accumulated gradient, zero drops it and the pending flag)."""
    import numpy as np

    from engine.backends.mock import MockTrainingBackend
    from engine.backends.train_transformers import TransformersTrainingBackend
    from engine.protocol import DatumInput, ForwardBackwardInput, LoraSpec

    toks = [1, 2, 3, 4]
    inp = ForwardBackwardInput([DatumInput(toks, {"target_tokens": np.array([2, 3, 4, 5])})])
    for be in (MockTrainingBackend(), TransformersTrainingBackend(str(tiny_model_dir))):
        be.create_adapter("a", LoraSpec(rank=4))
        assert be.adapter_grad("a", "norm") == 0.0
        be.forward_backward("a", inp)
        one = be.adapter_grad("a", "norm")
        be.forward_backward("a", inp)
        assert math.isclose(be.adapter_grad("a", "norm"), 2 * one, rel_tol=1e-6)  # sums
        assert be.has_pending_grad("a")
        assert be.adapter_grad("a", "zero") is None
        assert not be.has_pending_grad("a") and be.adapter_grad("a", "norm") == 0.0


def test_backends_import_nothing_above_them() -> None:
    """engine/backends is the bottom layer: no gateway, web framework, DB or Ray Serve."""
    banned = ("gateway", "fastapi", "starlette", "sqlalchemy", "ray", "engine.trainer")
    for path in sorted((ROOT / "engine" / "backends").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            else:
                continue
            for name in names:
                assert not name.startswith(banned), f"{path.name} imports {name}"
