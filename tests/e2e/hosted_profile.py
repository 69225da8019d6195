"""The pool's ``hosted`` profile: `twinkle serve` as a hosted service runs it.

Two gateway replicas sharing a real Redis, a fresh database on a real Postgres, JWT mode for the
Tinker SDK, per-user default quotas, and the tiny chat (fused execution) and vision-language
models (small image caps). The cookbook's ``modelscope/`` scripts
(tests/e2e/test_cookbook_hosted.py), the image tests (tests/e2e/test_vision_e2e.py), the
hostile-tenant test and the API and quota-path fuzz share one start of it.
"""

from __future__ import annotations

import subprocess

import pytest
import redis
import yaml

from tests.e2e.conftest import TWINKLE, Server, start_server
from tests.gateway.harness import fresh_postgres_db
from tests.launch import Launched

BASE = "twinkle/tiny-chat"
#: the service's defaults for every user ("quotas set"): generous enough for the cookbook scripts
DEFAULT_QUOTAS = {"max_training_clients": 4, "max_lora_rank": 32, "sample_tokens_per_minute": 50000}


def _model(name: str, **extra: object) -> dict:
    return {
        "name": name,
        "backend": "transformers",
        "execution": "sequential",  # no start-up probe: the CPUs are few
        "sampler_type": "torch",
        "trainer": {"num_replicas": 1, "num_cpus": 0.25},
        "sampler": {"num_replicas": 1, "num_cpus": 0.25},
        **extra,
    }


def start_hosted_server(
    tmp_path_factory: pytest.TempPathFactory, redis_url: str, postgres_url: str
) -> tuple[Server, Launched]:
    redis.Redis.from_url(redis_url).flushdb()  # the session's Redis: no other test's state
    data = tmp_path_factory.mktemp("hosted-data")
    config = {
        # twinkle/tiny-vl: twinkle/modelscope/multi_modal.py's vision-language model; its small
        # image caps are what tests/e2e/test_vision_e2e.py exceeds (the shipped images: < 600 B)
        "models": [
            # fused: one tenant's failing loss must not reach another's step in a fused pass
            # (tests/e2e/test_hostile_tenants.py)
            _model(BASE, execution="fused"),
            _model("twinkle/tiny-vl", images={"max_per_request": 8, "max_bytes": 4096}),
        ],
        "gateway": {
            "num_replicas": 2,
            "redis_url": redis_url,
            "jwt_enabled": True,
            "default_user_quotas": DEFAULT_QUOTAS,
        },
    }
    (data / "server.yaml").write_text(yaml.safe_dump(config))
    env = {"TWINKLE_DATABASE_URL": fresh_postgres_db(postgres_url)}
    return start_server(data, data / "server.yaml", env=env)


def set_quotas(server: Server, user: str, **quotas: int) -> None:
    """Override ``user``'s quotas with the real ``twinkle quotas set``."""
    limits = [f"{k}={v}" for k, v in quotas.items()]
    subprocess.run(
        [TWINKLE, "quotas", "set", "--user", user, *limits],
        env=server.env,
        check=True,
        capture_output=True,
        timeout=120,
    )
