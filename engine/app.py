"""Ray Serve deployments of the engine: one Trainer and one Sampler per configured base model.

The classes are the plain in-process `Trainer` / `Sampler`; this module only gives them Serve
options. `max_ongoing_requests` is high because a Trainer replica holds requests that wait for
their seq_id turn (they cost no compute while waiting).
"""

from __future__ import annotations

import re

from ray import serve
from ray.serve.deployment import Application

from engine.config import ModelConfig, ServerConfig
from engine.sampler import Sampler
from engine.trainer import Trainer

MAX_ONGOING = 4096


def deployment_suffix(model_name: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "-", model_name).strip("-").lower()


def trainer_app(model: ModelConfig, data_dir: str, gap_timeout: float) -> Application:
    return serve.deployment(
        Trainer,
        name=f"trainer-{deployment_suffix(model.name)}",
        num_replicas=model.trainer.num_replicas,
        max_ongoing_requests=MAX_ONGOING,
        ray_actor_options={"num_cpus": model.trainer.num_cpus, "num_gpus": model.trainer.num_gpus},
    ).bind(model.model_dump(), data_dir, gap_timeout=gap_timeout)


def sampler_app(model: ModelConfig, data_dir: str) -> Application:
    return serve.deployment(
        Sampler,
        name=f"sampler-{deployment_suffix(model.name)}",
        num_replicas=model.sampler.num_replicas,
        max_ongoing_requests=MAX_ONGOING,
        ray_actor_options={"num_cpus": model.sampler.num_cpus, "num_gpus": model.sampler.num_gpus},
    ).bind(model.model_dump(), data_dir)


def engine_apps(config: ServerConfig, data_dir: str) -> dict[str, dict[str, Application]]:
    """``{base_model: {"trainer": app, "sampler": app}}`` to bind into the gateway."""
    return {
        m.name: {
            "trainer": trainer_app(m, data_dir, config.seq_gap_timeout_seconds),
            "sampler": sampler_app(m, data_dir),
        }
        for m in config.models
    }
