"""A replica's custom Ray resources (``trainer: {resources: {trainer_node: 1}}``) reach its Serve
deployment's actor options, and bad amounts or reserved names are config errors naming the key."""

from __future__ import annotations

import pytest

from engine.app import actor_options, engine_apps
from engine.config import EngineConfig, ReplicaConfig
from engine.errors import ConfigError


def test_resources_become_ray_actor_options(tmp_path):
    cfg = EngineConfig.from_dict(
        {
            "models": [
                {
                    "name": "twinkle/tiny-chat",
                    "trainer": {"num_cpus": 0.5, "resources": {"trainer_node": 1}},
                }
            ],
            "engine_metrics": {"enabled": False},
        }
    )
    apps = engine_apps(cfg, str(tmp_path))["twinkle/tiny-chat"]
    trainer = apps["trainer"][0]._bound_deployment.ray_actor_options
    sampler = apps["sampler"][0]._bound_deployment.ray_actor_options
    assert trainer["resources"] == {"trainer_node": 1.0} and trainer["num_cpus"] == 0.5
    assert "resources" not in sampler  # not pinned: any node
    assert actor_options(ReplicaConfig()) == {"num_cpus": 0.5, "num_gpus": 0}


@pytest.mark.parametrize(
    ("resources", "words"),
    [({"trainer_node": 0}, "must be > 0"), ({"CPU": 1}, "use num_cpus/num_gpus")],
)
def test_bad_resources_are_config_errors(resources, words):
    raw = {"models": [{"name": "twinkle/tiny-chat", "sampler": {"resources": resources}}]}
    with pytest.raises(ConfigError, match="models.0.sampler") as err:
        EngineConfig.from_dict(raw)
    assert words in str(err.value)
