"""`twinkle serve`: run the whole service in the foreground on Ray Serve.

Owns: process start-up (migrations, the tiny model, then a private loopback Ray, or the existing
cluster named by ``ray.address`` / ``RAY_ADDRESS``, as cookbook/client/server/run_server.sh starts
one), the Serve application (gateway ingress bound to one Trainer and one Sampler per base model)
and a clean shutdown on SIGTERM / Ctrl-C: our Serve application goes, and with a private Ray no Ray
process is left behind (a joined cluster keeps running: its owner stops it).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time


def _prepare_env() -> None:
    # Ray binds every socket to loopback only with this set (environment.md §6); no usage stats;
    # no model hub at run time. Ray reads these when it is imported, so this runs first.
    for key, value in {
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
        "RAY_USAGE_STATS_ENABLED": "0",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }.items():
        os.environ.setdefault(key, value)


_prepare_env()

from ray import serve  # noqa: E402

from gateway.config import ServerConfig, check_replicas_share_state  # noqa: E402
from gateway.engine_client import EngineClient  # noqa: E402
from gateway.settings import Settings  # noqa: E402

log = logging.getLogger("twinkle.serve")
APP_NAME = "twinkle"


@serve.deployment(name="gateway", max_ongoing_requests=4096, ray_actor_options={"num_cpus": 0.25})
@serve.ingress()
class Gateway:
    """The FastAPI gateway as a Serve ingress; the app is built on the replica."""

    def __init__(self, settings: dict, config: dict, engines: dict) -> None:
        self._settings = Settings.model_validate(settings)
        self._config = ServerConfig.model_validate(config)
        self._engines = engines

    def __serve_build_asgi_app__(self):
        from gateway.main import create_app

        return create_app(
            self._settings, self._config, EngineClient(self._engines, ray_handles=True)
        )


def serve_main(config_path: str | None, host: str | None, port: int | None) -> int:
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    _prepare_env()
    config = ServerConfig.from_yaml(config_path) if config_path else ServerConfig()
    if host is not None:
        config.host = host
    if port is not None:
        config.port = port
    settings = Settings.from_env()
    check_replicas_share_state(settings.redis_url, config)
    settings.data_dir.mkdir(parents=True, exist_ok=True)

    from engine.base_models.registry import resolve_model_dir
    from gateway.db import upgrade_to_head

    upgrade_to_head(settings.database_url)
    for m in config.models:  # build/verify model folders once, before replicas race for them
        resolve_model_dir(m.name, str(settings.data_dir), m.path)

    import ray

    from engine.app import engine_apps

    stop = threading.Event()

    def on_signal(*_: object) -> None:
        stop.set()

    def install_handlers() -> None:
        # Ray's core worker installs a C-level SIGTERM handler that aborts the driver (exit -6)
        # without stopping Serve; ours must win, so re-install after ray.init and serve.run.
        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)

    install_handlers()
    t0 = time.monotonic()
    address = config.ray.address or os.environ.get("RAY_ADDRESS") or None
    if address and address != "local":  # Ray's own spelling of "start a private one"
        ray.init(address=address, logging_level=logging.ERROR)
        alive = [n for n in ray.nodes() if n.get("Alive")]
        cpus = sum(n.get("Resources", {}).get("CPU", 0) for n in alive)
        print(f"Joined the Ray cluster at {address}: {len(alive)} node(s), {cpus:g} CPUs")
    else:
        # "local", not None: with None, Ray would join whatever cluster `ray start` last recorded
        # in /tmp/ray/ray_current_cluster (another user's, or a dead one) instead of our own.
        ray.init(
            address="local",
            num_cpus=config.ray.num_cpus or max(os.cpu_count() or 1, 4),
            include_dashboard=False,
            object_store_memory=config.ray.object_store_memory_mb * 1024 * 1024,
            logging_level=logging.ERROR,
        )
    install_handlers()
    try:
        serve.start(http_options={"host": config.host, "port": config.port})
        app = Gateway.options(num_replicas=config.gateway.num_replicas).bind(
            settings.model_dump(mode="json"),
            config.model_dump(mode="json"),
            engine_apps(config, str(settings.data_dir)),
        )
        serve.run(app, name=APP_NAME, route_prefix="/", blocking=False)
        install_handlers()
        print(
            f"Twinkle ready at http://{config.host}:{config.port} "
            f"(models: {', '.join(m.name for m in config.models)}; "
            f"data: {settings.data_dir}; started in {time.monotonic() - t0:.1f}s)",
            flush=True,
        )
        while not stop.wait(0.5):
            pass
        print("Twinkle shutting down...", flush=True)
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(serve_main(None, None, None))
