"""Several Trainer and Sampler replicas of one base model (real Ray Serve).

An adapter lives in one Trainer replica, so every request about a model must reach it; a sampling
session sticks to one Sampler replica. The engine's own deployments (`engine.app.engine_apps`,
two replicas of each) are bound, nested in a dict of lists exactly as `twinkle serve` binds them
into the gateway, into a probe deployment that drives them through the gateway's `EngineClient`.
Runs in a child process: Ray must be configured before it is imported, and the other e2e tests'
server has its own Ray.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from tests.launch import count_ray_cluster
from tests.tiny_models import seed_models

pytestmark = [pytest.mark.e2e, pytest.mark.own_cluster]

SCRIPT = textwrap.dedent(
    """
    import json, sys
    import gateway.cli.serve  # noqa: F401  (sets Ray's loopback env before Ray is imported)
    import numpy as np
    import ray
    from ray import serve
    from engine.app import engine_apps
    from gateway.config import ServerConfig
    from engine.protocol import (AdamParams, DatumInput, ForwardBackwardInput, LoraSpec,
                                 SampleInput, SamplingParams)
    from gateway.engine_client import EngineClient

    BASE = "twinkle/tiny-chat"

    @serve.deployment
    class Probe:
        def __init__(self, engines):
            self.client = EngineClient(engines, ray_handles=True)

        async def run(self):
            c = self.client
            out = {"types": [type(t).__name__ for t in c.replicas(BASE, "trainer")]}
            toks = list(range(5, 37))
            inp = ForwardBackwardInput(data=[DatumInput(tokens=toks[:-1], loss_fn_inputs={
                "target_tokens": np.array(toks[1:]), "weights": np.ones(len(toks) - 1)})])
            models = [f"run-{i}" for i in range(6)]
            for m in models:
                await c.trainer(BASE).create_adapter(m, spec=LoraSpec(rank=4, seed=1), tenant="u")
            losses = []
            for m in models:
                fb = await c.trainer(BASE).forward_backward(m, seq_id=1, inp=inp)
                await c.trainer(BASE).optim_step(m, seq_id=2, params=AdamParams(learning_rate=1e-3))
                losses.append(float(fb.metrics["loss:sum"]))
            out["losses"] = losses
            out["resident"] = [s["pool"]["resident"] for s in await c.every_trainer(BASE).stats()]
            sample = SampleInput(prompt_tokens=[5, 6, 7], num_samples=1,
                                 params=SamplingParams(max_tokens=2, temperature=0))
            per_session = {}
            for sess in ["sess-a", "sess-b", "sess-c", "sess-d"]:
                before = [s["requests"] for s in await c.every_sampler(BASE).stats()]
                for _ in range(5):
                    await c.sampler(BASE, affinity=sess).sample(sample)
                after = [s["requests"] for s in await c.every_sampler(BASE).stats()]
                per_session[sess] = [a - b for a, b in zip(after, before)]
            out["per_session"] = per_session
            before = [s["requests"] for s in await c.every_sampler(BASE).stats()]
            for _ in range(30):
                await c.sampler(BASE).sample(sample)
            after = [s["requests"] for s in await c.every_sampler(BASE).stats()]
            out["unkeyed"] = [a - b for a, b in zip(after, before)]
            return out

    # "local": a bare init() would join whatever cluster `ray start` last recorded in
    # /tmp/ray/ray_current_cluster (a dead one, after another test or user stopped it)
    ray.init(address="local", num_cpus=4, include_dashboard=False, logging_level="ERROR")
    config = ServerConfig.model_validate({"models": [{
        "name": BASE, "execution": "sequential",
        "trainer": {"num_replicas": 2, "num_cpus": 0.2},
        "sampler": {"num_replicas": 2, "num_cpus": 0.2}}]})
    handle = serve.run(Probe.bind(engine_apps(config, sys.argv[1])), name="replicas",
                       route_prefix=None)
    print("RESULT " + json.dumps(handle.run.remote().result(timeout_s=240)), flush=True)
    serve.shutdown()
    ray.shutdown()
    """
)


def test_models_reach_their_trainer_and_sessions_stick_to_a_sampler(tmp_path):
    seed_models(tmp_path)
    env = dict(os.environ, TWINKLE_DATA_DIR=str(tmp_path), HF_HUB_OFFLINE="1")
    count_ray_cluster()  # the child's local Ray
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=400,
    )
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")]
    assert out.returncode == 0 and lines, out.stdout[-3000:] + out.stderr[-3000:]
    res = json.loads(lines[-1][len("RESULT ") :])
    assert res["types"] == ["DeploymentHandle", "DeploymentHandle"]  # nested binding resolved
    # every model trained on the replica that holds it (a wrong replica raises "unknown model")
    assert len(res["losses"]) == 6
    assert len(set(res["losses"])) == 1  # same seed, same data, same first loss everywhere
    assert sum(res["resident"]) == 6 and all(r > 0 for r in res["resident"]), res["resident"]
    for sess, counts in res["per_session"].items():
        assert sorted(counts) == [0, 5], (sess, counts)  # all 5 requests on one replica
    # the four sessions do not all hash to one replica, and unkeyed requests spread out
    assert {c.index(5) for c in res["per_session"].values()} == {0, 1}, res["per_session"]
    assert sum(res["unkeyed"]) == 30 and min(res["unkeyed"]) > 0, res["unkeyed"]
