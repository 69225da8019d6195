"""Ray Serve deployments of the engine: one Trainer and one Sampler per configured base model.

The classes are the plain in-process `Trainer` / `Sampler`; this module only gives them Serve
options. ``num_replicas: N`` becomes N single-replica deployments that the gateway routes between
itself (gateway/engine_client/transport.py). `max_ongoing_requests` is high because a Trainer
replica holds requests that wait for their seq_id turn (they cost no compute while waiting). With
``engine_metrics.enabled`` each replica serves its Prometheus metrics and lists itself in the data
dir's target folder (engine/telemetry/exporter.py), which `engine_apps` clears first. A
replica's ``resources`` pin it to the nodes of a multi-node cluster that offer them; when that node
dies, Serve keeps the replica pending and places it again once a node with the resource joins.
Every replica is given the checkpoint storage's id and refuses to start on a node that does not
reach that storage (engine/storage.py).
"""

from __future__ import annotations

import re

from ray import serve
from ray.serve.deployment import Application

from engine.config import (
    SHUTDOWN_WAIT_LOOP_S,
    EngineConfig,
    EngineMetricsConfig,
    ModelConfig,
    ReplicaConfig,
)
from engine.sampler import Sampler
from engine.storage import SharedDirStorage
from engine.telemetry.exporter import clear_targets
from engine.trainer import Trainer

MAX_ONGOING = 4096


def deployment_suffix(model_name: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "-", model_name).strip("-").lower()


def _replica_name(role: str, model: ModelConfig, i: int) -> str:
    base = f"{role}-{deployment_suffix(model.name)}"
    return base if i == 0 else f"{base}-r{i}"


def actor_options(replica: ReplicaConfig) -> dict:
    """Ray actor options of one replica: CPUs, GPUs and the custom resources that pin it to
    nodes (``trainer: {resources: {trainer_node: 1}}``)."""
    opts: dict = {"num_cpus": replica.num_cpus, "num_gpus": replica.num_gpus}
    if replica.resources:
        opts["resources"] = dict(replica.resources)
    return opts


def _telemetry(metrics: EngineMetricsConfig | None, name: str) -> dict | None:
    if metrics is None or not metrics.enabled:
        return None
    return {"replica": name, "host": metrics.host}


def trainer_app(
    model: ModelConfig,
    data_dir: str,
    gap_timeout: float,
    i: int = 0,
    metrics: EngineMetricsConfig | None = None,
    storage_id: str | None = None,
) -> Application:
    name = _replica_name("trainer", model, i)
    return serve.deployment(
        Trainer,
        name=name,
        num_replicas=1,
        max_ongoing_requests=MAX_ONGOING,
        graceful_shutdown_wait_loop_s=SHUTDOWN_WAIT_LOOP_S,
        ray_actor_options=actor_options(model.trainer),
    ).bind(
        model.model_dump(),
        data_dir,
        gap_timeout=gap_timeout,
        telemetry=_telemetry(metrics, name),
        storage_id=storage_id,
    )


def sampler_app(
    model: ModelConfig,
    data_dir: str,
    i: int = 0,
    metrics: EngineMetricsConfig | None = None,
    storage_id: str | None = None,
) -> Application:
    name = _replica_name("sampler", model, i)
    return serve.deployment(
        Sampler,
        name=name,
        num_replicas=1,
        max_ongoing_requests=MAX_ONGOING,
        graceful_shutdown_wait_loop_s=SHUTDOWN_WAIT_LOOP_S,
        ray_actor_options=actor_options(model.sampler),
    ).bind(model.model_dump(), data_dir, telemetry=_telemetry(metrics, name), storage_id=storage_id)


def check_models(config: EngineConfig, data_dir: str) -> None:
    """Refuse, before any replica starts, a Megatron model its parallel sizes cannot split or
    whose architecture the backend cannot host (reads config.json only; a ConfigError names
    the field)."""
    from engine.backends.megatron.arch import read_arch

    for m in config.models:
        if m.backend == "megatron":
            mc = m.megatron_config()
            read_arch(m.files_dir(data_dir), tp=mc.tensor_parallel, pp=mc.pipeline_parallel)


def engine_apps(config: EngineConfig, data_dir: str) -> dict[str, dict[str, list[Application]]]:
    """``{base_model: {"trainer": [app per replica], "sampler": [...]}}`` to bind into the
    gateway. Each replica is its own single-replica deployment, because the gateway must choose
    the replica (an adapter lives in one Trainer; a sampling session sticks to one Sampler): see
    gateway/engine_client/transport.py."""
    check_models(config, data_dir)
    em = config.engine_metrics
    clear_targets(data_dir)  # targets of an earlier run's replicas (a crash leaves them behind)
    # every replica checks, on its node, that it reaches this storage (engine/storage.py)
    sid = SharedDirStorage(data_dir).ensure_id()
    gap = config.seq_gap_timeout_seconds
    return {
        m.name: {
            "trainer": [
                trainer_app(m, data_dir, gap, i, em, sid) for i in range(m.trainer.num_replicas)
            ],
            "sampler": [
                sampler_app(m, data_dir, i, em, sid) for i in range(m.sampler.num_replicas)
            ],
        }
        for m in config.models
    }
