"""Base models: the name → directory registry and the offline tiny-model builders."""

from engine.base_models.registry import known_model_names, resolve_model_dir
from engine.config import TINY_MODEL_NAME, TINY_VL_MODEL_NAME

__all__ = ["TINY_MODEL_NAME", "TINY_VL_MODEL_NAME", "known_model_names", "resolve_model_dir"]
