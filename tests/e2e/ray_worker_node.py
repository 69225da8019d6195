"""A Ray worker node as its own process: ``python -m tests.e2e.ray_worker_node ARGS_JSON``.

`ray start --address` cannot join a loopback-only head on one host: with
``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` (what binds Ray to 127.0.0.1, environment.md §6) it refuses
to start a worker node, and without it, it replaces the head's 127.0.0.1 by the host's primary
address, where the head does not listen. So this starts the node the way Ray's own
`ray.cluster_utils.Cluster.add_node` does (a `ray._private.node.Node`, not the head), with the
variable set, and then waits until it is killed (tests/e2e/ray_cluster.py kills its process group:
the node's raylet, object store, agents and workers die with it).
"""

from __future__ import annotations

import json
import os
import signal
import sys


def main(args: dict) -> None:
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    import ray._private.node
    import ray._private.parameter

    params = ray._private.parameter.RayParams(
        gcs_address=args["address"],
        node_ip_address="127.0.0.1",
        num_cpus=args["num_cpus"],
        num_gpus=0,
        resources=args["resources"],
        object_store_memory=args["object_store_memory"],
        temp_dir=args["temp_dir"],
        min_worker_port=0,
        max_worker_port=0,
        include_log_monitor=False,
        **args["ports"],
    )
    ray._private.node.Node(params, head=False, shutdown_at_exit=True, spawn_reaper=False)
    sys.stdout.write("worker node started\n")
    sys.stdout.flush()
    signal.sigwait({signal.SIGTERM, signal.SIGINT})


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
