"""Unit-test fixtures: 2 torch threads, one tiny model built per session."""

from __future__ import annotations

from pathlib import Path

import pytest


def _torch_threads() -> None:
    try:
        import torch
    except ImportError:  # tests that need no torch still run
        return
    torch.set_num_threads(2)


_torch_threads()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny chat model (engine/base_models/tiny.py), built once per test session."""
    from engine.base_models.tiny import build_tiny

    return build_tiny(tmp_path_factory.mktemp("models") / "tiny-chat")


@pytest.fixture(scope="session")
def tiny_vl_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny vision-language model (engine/base_models/tiny_vl.py), built once per session."""
    from engine.base_models.tiny_vl import build_tiny_vl

    return build_tiny_vl(tmp_path_factory.mktemp("models") / "tiny-vl")
