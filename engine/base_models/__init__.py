"""Base models: the name → directory registry and the offline tiny-model builder."""

from engine.base_models.registry import TINY_MODEL_NAME, known_model_names, resolve_model_dir

__all__ = ["TINY_MODEL_NAME", "known_model_names", "resolve_model_dir"]
