"""Run by tests/e2e/test_controller_loop.py in its own process: a real local Ray and Serve whose
controller has gateway/cli/controller_loop.py installed the way `twinkle serve` installs it (the
callback environment variable), timing what the quiet loop must not slow down.

Usage: python quiet_controller_probe.py INTERVAL_S; prints one JSON line."""

from __future__ import annotations

import json
import logging
import os
import sys
import time

os.environ["RAY_SERVE_CONTROLLER_CALLBACK_IMPORT_PATH"] = "gateway.cli.controller_loop.install"
os.environ["TWINKLE_SERVE_QUIET_LOOP_S"] = sys.argv[1]
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import ray  # noqa: E402
from ray import serve  # noqa: E402


@serve.deployment(num_replicas=1, ray_actor_options={"num_cpus": 0})
class Echo:
    def __call__(self, x: int) -> tuple[int, int]:
        return x, os.getpid()


def _skipped(controller: object) -> int | None:
    from gateway.cli import controller_loop

    return None if controller_loop.GATE is None else controller_loop.GATE.skipped


def _skipped_now() -> int | None:
    controller = serve.context._get_global_client()._controller
    return ray.get(controller.__ray_call__.remote(_skipped))


def main() -> None:
    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level=logging.ERROR)
    out: dict[str, float | int | None] = {}
    try:
        t0 = time.monotonic()
        a = serve.run(Echo.bind(), name="a", route_prefix=None)
        out["deploy_s"] = time.monotonic() - t0
        _, pid = a.remote(1).result(timeout_s=30)
        out["skipped_after_deploy"] = _skipped_now()
        time.sleep(float(sys.argv[2]) if len(sys.argv) > 2 else 8.0)  # quiet from 5 s on
        out["skipped_idle"] = _skipped_now()

        # a second application while quiet: DEPLOYING at once, so Ray's pace
        t0 = time.monotonic()
        b = serve.run(Echo.bind(), name="b", route_prefix=None)
        out["redeploy_s"] = time.monotonic() - t0
        assert b.remote(2).result(timeout_s=30)[0] == 2
        time.sleep(7)  # quiet again

        # a replica that dies while quiet: found by a full pass, replaced
        os.kill(pid, 9)
        t0 = time.monotonic()
        while True:
            try:
                _, new_pid = a.remote(3).result(timeout_s=5)
                if new_pid != pid:
                    break
            except Exception:  # the dead replica, or none yet
                pass
            if time.monotonic() - t0 > 150:
                raise SystemExit("the killed replica was not replaced in 150 s")
            time.sleep(0.2)
        out["replace_s"] = time.monotonic() - t0
        time.sleep(7)

        t0 = time.monotonic()
        serve.delete("b")
        out["delete_s"] = time.monotonic() - t0
        time.sleep(7)
        t0 = time.monotonic()
        serve.shutdown()
        out["shutdown_s"] = time.monotonic() - t0
    finally:
        ray.shutdown()
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
