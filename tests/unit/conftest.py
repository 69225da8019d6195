"""Unit-test fixtures: 2 torch threads, the session's tiny models."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.config import TINY_MODEL_NAME, TINY_VL_MODEL_NAME
from tests.tiny_models import built


def _torch_threads() -> None:
    try:
        import torch
    except ImportError:  # tests that need no torch still run
        return
    torch.set_num_threads(2)


_torch_threads()


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    """The tiny chat model (engine/base_models/tiny.py), the session's build."""
    return built(TINY_MODEL_NAME)


@pytest.fixture(scope="session")
def tiny_vl_model_dir() -> Path:
    """The tiny vision-language model (engine/base_models/tiny_vl.py), the session's build."""
    return built(TINY_VL_MODEL_NAME)
