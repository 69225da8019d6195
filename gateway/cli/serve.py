"""`twinkle serve`: run the whole service in the foreground on Ray Serve.

Owns: process start-up (the profile's checks, migrations — or, with ``profile: production``,
only a check that `twinkle migrate` brought the database to head —, the tiny model, then a private
loopback Ray, or the existing cluster named by ``ray.address`` / ``RAY_ADDRESS``, as
cookbook/client/server/run_server.sh starts one), the Serve application (gateway ingress on the
head node, bound to one Trainer and one Sampler per base model, which a replica's ``resources``
pin to other nodes) and a graceful shutdown on SIGTERM / Ctrl-C: the gateway replicas drain
(gateway/lifecycle.py; the flag and their pending counts travel through Ray's internal KV, which
every replica reaches), then our Serve application goes, and with a private Ray no Ray process is
left behind (a joined cluster keeps running: its owner stops it).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
import time
from typing import Any


def _prepare_env() -> None:
    # Ray binds every socket to loopback only with this set (environment.md §6); no usage stats;
    # no model hub at run time. Ray reads these when it is imported, so this runs first.
    for key, value in {
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
        "RAY_USAGE_STATS_ENABLED": "0",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        # Ray's log monitor re-globs the log folder on each of its 10 passes a second while the
        # folder holds fewer than this many files; at 0 it does so every 0.5 s
        # (LOG_NAME_UPDATE_INTERVAL_S), so a new worker's output reaches our log <= 0.5 s later
        # and the idle monitor uses 6.5 -> ~3 ms of CPU per second
        "RAY_LOG_MONITOR_MANY_FILES_THRESHOLD": "0",
        # Serve's replicas and routers hand their cached request metrics (ray_serve_*, which
        # Prometheus reads every 15 s; autoscaling has its own push) to Ray's metric API every
        # 1 s instead of every 0.1 s: ~3 ms of CPU per second less per idle replica
        "RAY_SERVE_METRICS_EXPORT_INTERVAL_MS": "1000",
    }.items():
        os.environ.setdefault(key, value)


_prepare_env()

from ray import serve  # noqa: E402

from engine.config import SHUTDOWN_WAIT_LOOP_S  # noqa: E402
from gateway.cli import controller_loop  # noqa: E402
from gateway.cli.housekeeping import lower_housekeeping  # noqa: E402
from gateway.config import (  # noqa: E402
    ServerConfig,
    check_profile,
    check_replicas_share_state,
)
from gateway.engine_client import EngineClient  # noqa: E402
from gateway.settings import Settings  # noqa: E402

log = logging.getLogger("twinkle.serve")
APP_NAME = "twinkle"
#: Ray internal-KV keys of the drain: the flag the driver sets, and the prefix under which each
#: gateway replica publishes {"pending": n, "uncollected": m, "t": wall time} while it drains
#: Serve calls the function at this import path in its controller's process as it starts
CONTROLLER_CALLBACK = "RAY_SERVE_CONTROLLER_CALLBACK_IMPORT_PATH"
DRAIN_FLAG = b"twinkle:drain"
DRAIN_STATUS = b"twinkle:drain-status:"
#: how often a gateway replica looks at the drain flag (one GCS read; it runs all the time)
DRAIN_POLL_S = 0.5
#: while draining: how often a replica publishes its counts and the driver reads them
DRAIN_REPORT_S = 0.1
#: after the last in-flight future finished, how long the driver keeps the gateway up at most so
#: clients collect finished results they have not retrieved yet (a long poll answers within
#: milliseconds); with none left to collect it stops at once instead of waiting all 2 s
DRAIN_COLLECT_S = 2.0
#: Ray gives the head node (only) 1 unit of node:__internal_head__; a sliver of it keeps the
#: gateway where the head is (Ray Train pins its state actor the same way)
HEAD_RESOURCE = {"node:__internal_head__": 0.001}


def _kv() -> Any:
    from ray.experimental import internal_kv

    return internal_kv


class _Gateway:
    """The FastAPI gateway on a Serve replica; the app is built on the replica. A thread watches
    the drain flag and, once it is set, drains the app and publishes its pending count."""

    def __init__(self, settings: dict, config: dict, engines: dict) -> None:
        self._settings = Settings.model_validate(settings)
        self._config = ServerConfig.model_validate(config)
        self._engines = engines
        if self._config.profile == "production":  # each replica checks; only `migrate` migrates
            from gateway.db import check_at_head

            check_at_head(self._settings.database_url)
        self._app: Any = None
        threading.Thread(target=self._watch_drain, name="drain-watch", daemon=True).start()

    def _build_app(self) -> Any:
        from gateway.main import create_app

        self._app = create_app(
            self._settings, self._config, EngineClient(self._engines, ray_handles=True)
        )
        return self._app

    def _watch_drain(self) -> None:
        kv, me = _kv(), serve.get_replica_context().replica_id.unique_id.encode()
        draining = False
        while True:
            time.sleep(DRAIN_REPORT_S if draining else DRAIN_POLL_S)
            try:
                if self._app is None or not kv._internal_kv_get(DRAIN_FLAG):
                    continue
                drain = self._app.state.drain
                drain.start()
                draining = True
                status = {
                    "pending": _pending(drain),
                    "uncollected": int(drain.uncollected()),
                    "t": time.time(),
                }
                kv._internal_kv_put(DRAIN_STATUS + me, json.dumps(status).encode())
            except Exception:  # the GCS going away at shutdown; keep serving meanwhile
                log.debug("drain watch", exc_info=True)


class DirectGateway(_Gateway):
    """``gateway.ingress: direct`` (and ``auto`` with one replica, the default): the replica
    serves HTTP itself on the configured port (gateway/direct_http.py); Serve's proxy is not
    started. Serve restarts a replica whose server stopped (`check_health`)."""

    def __init__(self, settings: dict, config: dict, engines: dict) -> None:
        super().__init__(settings, config, engines)
        from gateway.direct_http import DirectHTTP

        self._http = DirectHTTP(self._build_app(), self._config.host, self._config.port)

    def check_health(self) -> None:
        if not self._http.alive():
            raise RuntimeError(f"the gateway's HTTP server on {self._http.address} stopped")

    def __del__(self) -> None:  # Serve calls it when the replica shuts down
        http = getattr(self, "_http", None)
        if http is not None:
            http.stop()


@serve.ingress()
class ProxiedGateway(_Gateway):
    """``gateway.ingress: serve_proxy``: Serve's proxy listens and forwards every request to
    this replica as an actor call."""

    def __serve_build_asgi_app__(self):
        return self._build_app()


def gateway_deployment(config: ServerConfig) -> Any:
    direct = config.gateway.direct_ingress()
    return serve.deployment(
        DirectGateway if direct else ProxiedGateway,
        name="gateway",
        num_replicas=config.gateway.num_replicas,
        max_ongoing_requests=4096,
        graceful_shutdown_wait_loop_s=SHUTDOWN_WAIT_LOOP_S,  # drained before Serve stops it
        ray_actor_options={"num_cpus": 0.25, "resources": HEAD_RESOURCE},
    )


def _pending(drain: Any) -> int:
    # counted on this thread while the event loop mutates the store: retry a torn read
    for _ in range(10):
        try:
            return int(drain.pending())
        except RuntimeError:  # dictionary changed size during iteration
            time.sleep(0.01)
    return 1


def _drain(config: ServerConfig) -> None:
    """Ask every gateway replica to drain, wait until all of them report no pending future, then
    until their finished results are collected (at most `DRAIN_COLLECT_S`); or the timeout."""
    kv, t0 = _kv(), time.time()
    kv._internal_kv_put(DRAIN_FLAG, b"1")

    def counts() -> tuple[int, int] | None:
        """(pending, uncollected) over every replica, once each has reported since t0."""
        fresh = []
        for key in kv._internal_kv_list(DRAIN_STATUS):
            raw = kv._internal_kv_get(key)
            status = json.loads(raw) if raw else None
            if status and status["t"] >= t0:
                fresh.append(status)
        if len(fresh) < config.gateway.num_replicas:
            return None
        return sum(s["pending"] for s in fresh), sum(s.get("uncollected", 0) for s in fresh)

    deadline = time.monotonic() + config.drain_timeout_seconds
    now: tuple[int, int] | None = None
    while time.monotonic() < deadline:
        time.sleep(DRAIN_REPORT_S)
        now = counts()
        if now is not None and now[0] == 0:
            break
    else:
        pending = "an unknown number of" if now is None else now[0]
        print(
            f"Drain timed out after {config.drain_timeout_seconds:g}s with {pending} request(s) "
            "in flight; they fail (their clients see the connection close)",
            flush=True,
        )
        return
    print("Drained: no request in flight", flush=True)
    until = time.monotonic() + DRAIN_COLLECT_S
    while now is not None and now[1] > 0 and time.monotonic() < until:
        time.sleep(DRAIN_REPORT_S)
        now = counts() or now
    if now is not None and now[1] > 0:
        print(f"{now[1]} finished result(s) not collected within {DRAIN_COLLECT_S:g}s", flush=True)


def _clear_drain_keys() -> None:
    """A joined cluster outlives us: forget an earlier run's drain flag and statuses."""
    kv = _kv()
    kv._internal_kv_del(DRAIN_FLAG)
    kv._internal_kv_del(DRAIN_STATUS, del_by_prefix=True)


def _quiet_controller(interval_s: float) -> None:
    """Serve's controller of the local Ray we start skips its reconcile passes while Serve is
    quiet (gateway/cli/controller_loop.py). Ray's processes inherit this environment."""
    if interval_s <= 0:
        return
    callback = os.environ.get(CONTROLLER_CALLBACK)
    if callback and callback != controller_loop.IMPORT_PATH:
        log.warning(
            "%s is set (%s): Serve's control loop left as Ray runs it",
            CONTROLLER_CALLBACK,
            callback,
        )
        return
    os.environ[CONTROLLER_CALLBACK] = controller_loop.IMPORT_PATH
    os.environ[controller_loop.ENV] = f"{interval_s:g}"
    log.info("Serve's controller: a full reconcile every %gs while Serve is quiet", interval_s)


def _preflight(
    config_path: str | None, host: str | None, port: int | None
) -> tuple[ServerConfig, Settings, str | None]:
    """Everything checked before Ray starts: the config, the shared state and profile, the port
    (a private cluster only), the database at head, the model folders. Returns the config, the
    settings and the Ray address to join (None: start a private cluster)."""
    config = ServerConfig.from_yaml(config_path) if config_path else ServerConfig()
    if host is not None:
        config.host = host
    if port is not None:
        config.port = port
    settings = Settings.from_env()
    check_replicas_share_state(settings.redis_url, config)
    check_profile(settings.database_url, settings.redis_url, config)
    address = config.ray.address or os.environ.get("RAY_ADDRESS") or None
    if address == "local":  # Ray's own spelling of "start a private one"
        address = None
    if address is None:  # the gateway will listen here: fail fast
        from engine.errors import ConfigError
        from gateway.direct_http import PortInUseError, check_port_free

        try:
            check_port_free(config.host, config.port)
        except PortInUseError as exc:
            raise ConfigError(str(exc)) from None
    settings.data_dir.mkdir(parents=True, exist_ok=True)

    from engine.base_models.registry import resolve_model_dir
    from gateway.db import check_at_head, upgrade_to_head

    if config.profile == "production":
        check_at_head(settings.database_url)  # the deploy ran `twinkle migrate` once
    else:
        upgrade_to_head(settings.database_url)  # one at a time (an advisory lock)
    for m in config.models:  # build/verify model folders once, before replicas race for them
        resolve_model_dir(m.name, str(settings.data_dir), m.path)
    return config, settings, address


def _start_ray(config: ServerConfig, address: str | None) -> None:
    """Join the cluster at ``address``, or start a private one sized by the config."""
    import ray

    if address is not None:
        ray.init(address=address, logging_level=logging.ERROR)
        alive = [n for n in ray.nodes() if n.get("Alive")]
        cpus = sum(n.get("Resources", {}).get("CPU", 0) for n in alive)
        print(f"Joined the Ray cluster at {address}: {len(alive)} node(s), {cpus:g} CPUs")
        return
    _quiet_controller(config.ray.serve_quiet_loop_s)
    # "local", not None: with None, Ray would join whatever cluster `ray start` last recorded
    # in /tmp/ray/ray_current_cluster (another user's, or a dead one) instead of our own.
    ray.init(
        address="local",
        num_cpus=config.ray.num_cpus or max(os.cpu_count() or 1, 4),
        include_dashboard=False,
        object_store_memory=config.ray.object_store_memory_mb * 1024 * 1024,
        logging_level=logging.ERROR,
    )


def _deploy(config: ServerConfig, settings: Settings) -> None:
    """Start Serve (its proxy, or none with direct ingress) and run the gateway application,
    which binds the engine's Trainer and Sampler deployments."""
    from engine.app import engine_apps

    _clear_drain_keys()
    if config.gateway.direct_ingress():
        # The gateway replicas (on the head) listen themselves; no Serve proxy anywhere.
        serve.start(proxy_location="Disabled")
    else:
        # One HTTP proxy, on the head, with the gateway: worker nodes only run
        # Trainers/Samplers (and two nodes on one host would both want the port).
        serve.start(
            proxy_location="HeadOnly",
            http_options={"host": config.host, "port": config.port},
        )
    app = gateway_deployment(config).bind(
        settings.model_dump(mode="json"),
        config.model_dump(mode="json"),
        engine_apps(config, str(settings.data_dir)),
    )
    serve.run(
        app,
        name=APP_NAME,
        route_prefix=None if config.gateway.direct_ingress() else "/",
        blocking=False,
    )


def _wait(stop: threading.Event, nice: int) -> None:
    """Until a signal: keep Ray's housekeeping processes at ``nice``."""
    ticks = 0
    while not stop.wait(0.5):
        ticks += 1
        if ticks % 60 == 0:  # every 30 s: a restarted controller or agent starts at nice 0
            lower_housekeeping(os.getpid(), nice)


def serve_main(config_path: str | None, host: str | None, port: int | None) -> int:
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    _prepare_env()
    config, settings, address = _preflight(config_path, host, port)

    import ray

    import engine.app  # noqa: F401 - the engine (torch) loads before Ray starts and the clock runs

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
    _start_ray(config, address)
    install_handlers()
    try:
        _deploy(config, settings)
        install_handlers()
        nice = (
            config.ray.housekeeping_nice if address is None else 0
        )  # a joined cluster is not ours
        lowered = lower_housekeeping(os.getpid(), nice)
        log.info("housekeeping at nice %d: %s", nice, ", ".join(lowered) or "none")
        print(
            f"Twinkle ready at http://{config.host}:{config.port} "
            f"(models: {', '.join(m.name for m in config.models)}; "
            f"data: {settings.data_dir}; started in {time.monotonic() - t0:.1f}s)",
            flush=True,
        )
        _wait(stop, nice)
        print("Twinkle draining...", flush=True)
        _drain(config)
        print("Twinkle shutting down...", flush=True)
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(serve_main(None, None, None))
