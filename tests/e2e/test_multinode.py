"""Multi-node Ray: `twinkle serve` joins a two-node cluster on this host (tests/e2e/ray_cluster.py),
its Trainer is pinned by a custom resource to the worker node (checked through Ray's state API),
the Tinker SDK trains, saves and samples (the Sampler on the head loads what the Trainer on the
worker saved: one shared data dir), and when the worker node dies the service reports the replica
unhealthy, then recovers once a node with the resource joins again (Serve re-places the replica).
"""

from __future__ import annotations

import time

import httpx
import pytest
import tinker
from ray.util.state import list_actors, list_nodes
from tinker import types

from tests.e2e.conftest import start_server, stop_server
from tests.e2e.ray_cluster import TwoNodeCluster

pytestmark = [pytest.mark.e2e, pytest.mark.own_cluster]
BASE = "twinkle/tiny-chat"
TRAINER_CLASS = "ServeReplica:twinkle:trainer-twinkle-tiny-chat"
CONFIG = """
models:
  - name: twinkle/tiny-chat
    execution: sequential
    trainer: {num_cpus: 0.5, torch_threads: 1, resources: {trainer_node: 1}}
    sampler: {num_cpus: 0.5, torch_threads: 1}
engine_metrics: {enabled: false}
drain_timeout_seconds: 10
"""
TOKENS = list(range(20, 33))


def _wait(what: str, check, timeout: float, every: float = 1.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            out = check()
        except Exception:  # the cluster or the server still coming up
            out = None
        if out:
            return out
        time.sleep(every)
    pytest.fail(f"timed out after {timeout:g}s waiting for {what}")


def _worker_node_id(cluster: TwoNodeCluster) -> str | None:
    for n in list_nodes(address=cluster.dashboard, detail=True):
        if n.state == "ALIVE" and "trainer_node" in (n.resources_total or {}):
            return n.node_id
    return None


def _trainer_node_id(cluster: TwoNodeCluster) -> str | None:
    alive = list_actors(
        address=cluster.dashboard,
        filters=[("class_name", "=", TRAINER_CLASS), ("state", "=", "ALIVE")],
    )
    return alive[0].node_id if len(alive) == 1 else None


def _health(url: str) -> int:
    return httpx.get(f"{url}/api/v1/healthz", timeout=15).status_code


@pytest.fixture(scope="module")
def cluster():
    c = TwoNodeCluster(head_cpus=2, worker_cpus=1, resources={"trainer_node": 1})
    try:
        c.start_head()
        c.start_worker()
        _wait("two alive nodes", lambda: c.revive() or _worker_node_id(c), 240, every=2)
        yield c
    finally:
        c.close()  # every Ray process either node started


def datum() -> types.Datum:
    return types.Datum(
        model_input=types.ModelInput.from_ints(TOKENS[:-1]),
        loss_fn_inputs={"target_tokens": TOKENS[1:], "weights": [1.0] * (len(TOKENS) - 1)},
    )


def test_trainer_on_the_worker_node_survives_its_death(cluster, tmp_path):
    config = tmp_path / "server.yaml"
    config.write_text(CONFIG)
    env = {**cluster.env, "RAY_ADDRESS": cluster.address}
    srv, log = start_server(tmp_path, config, env=env)
    try:
        assert "Joined the Ray cluster" in (tmp_path / "serve.log").read_text()
        worker = _worker_node_id(cluster)
        assert worker is not None and _trainer_node_id(cluster) == worker

        sc = tinker.ServiceClient(base_url=srv.url, api_key=srv.create_key("alice"))
        tc = sc.create_lora_training_client(base_model=BASE, rank=4, seed=3)
        for _ in range(2):
            fb = tc.forward_backward([datum()], "cross_entropy")
            tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
            assert fb.result().metrics["loss:sum"] > 0
        state = tc.save_state("s1").result().path  # written by the Trainer on the worker node
        sampler = tc.save_weights_and_get_sampling_client()  # loaded by the Sampler on the head
        out = sampler.sample(
            types.ModelInput.from_ints(TOKENS[:4]),
            num_samples=1,
            sampling_params=types.SamplingParams(max_tokens=3, temperature=0.0),
        ).result()
        assert 1 <= len(out.sequences[0].tokens) <= 3

        cluster.stop_worker()  # the node dies, and the Trainer replica with it
        _wait("healthz 503", lambda: _health(srv.url) == 503, 90)
        ready = httpx.get(f"{srv.url}/api/v1/readyz", timeout=15)
        assert ready.status_code == 503 and ready.json()["status"] == "not_ready"
        assert httpx.get(f"{srv.url}/api/v1/livez", timeout=5).status_code == 200

        cluster.start_worker()  # a node with the resource joins: Serve places the replica there
        _wait("healthz 200", lambda: cluster.revive() or _health(srv.url) == 200, 240, every=2)
        new_worker = _worker_node_id(cluster)
        assert new_worker not in (None, worker)
        assert _trainer_node_id(cluster) == new_worker
        # the new replica loads what the dead one saved (shared data dir)
        resumed = sc.create_training_client_from_state(state)
        loss = resumed.forward([datum()], "cross_entropy").result().metrics["loss:sum"]
        assert loss > 0
        sc.close("success")
    finally:
        stop_server(srv, log)
        assert srv.proc.returncode == 0, (tmp_path / "serve.log").read_text()[-3000:]
