"""Fault test: the gateway is restarted mid-training with Redis configured, and the unmodified
tinker SDK finishes its run with the same losses as an uninterrupted run.

What restarts is the gateway (the FastAPI app behind a real uvicorn HTTP server, as one Ray Serve
gateway replica is), not the Trainer: adapters and optimizer state live in the Trainer's memory, so
a restart of the whole `twinkle serve` loses them by design (only saved checkpoints survive). The
Trainer here is a real in-process Trainer on the tiny model. The restart happens while a
forward_backward is inside the Trainer (held there by a gate on the backend) and an optim_step
waits behind it: the new gateway takes both futures over from Redis, re-runs their jobs, and the
Trainer answers the repeats with the first execution's results, so nothing runs twice.
"""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import redis
import tinker
import uvicorn
from tinker import types

from engine.config import ModelConfig
from engine.sampler import Sampler
from engine.trainer import Trainer
from gateway.config import ServerConfig
from gateway.context import services_of
from gateway.db import upgrade_to_head
from gateway.engine_client import EngineClient
from gateway.main import create_app
from gateway.settings import Settings
from tests.gateway.harness import new_key, sqlite_url
from tests.services import free_port

BASE = "twinkle/tiny-chat"
STEPS, RESTART_AT = 5, 2
_rng = np.random.default_rng(3)
DATA = [
    types.Datum(
        model_input=types.ModelInput.from_ints(s[:-1]),
        loss_fn_inputs={"target_tokens": s[1:], "weights": [1.0] * (len(s) - 1)},
    )
    for s in (_rng.integers(10, 500, size=10).tolist() for _ in range(3))
]


class Gateway:
    """Gateways started and stopped one after another on one port and one event loop."""

    def __init__(self, settings: Settings, config: ServerConfig, engines: dict) -> None:
        self.settings, self.config, self.engines = settings, config, engines
        self.port = free_port()
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.server: uvicorn.Server | None = None
        self.done = None
        self.apps: list = []

    def start(self) -> None:
        app = create_app(self.settings, self.config, EngineClient(self.engines, ray_handles=False))
        self.apps.append(app)
        cfg = uvicorn.Config(
            app,
            host="127.0.0.1",
            port=self.port,
            log_level="warning",
            timeout_graceful_shutdown=2,
            lifespan="on",
        )
        self.server = uvicorn.Server(cfg)
        self.done = asyncio.run_coroutine_threadsafe(self.server.serve(), self.loop)
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline, "gateway did not start"
            time.sleep(0.05)

    def stop(self) -> None:
        assert self.server is not None
        self.server.should_exit = True
        self.done.result(timeout=30)

    def close(self) -> None:
        if self.server is not None and not self.done.done():
            self.stop()

        async def cancel_rest() -> None:  # the Trainer's scheduler loop lives on this loop too
            rest = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in rest:
                t.cancel()
            await asyncio.gather(*rest, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(cancel_rest(), self.loop).result(timeout=10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)


@pytest.fixture
def env(tmp_path: Path, redis_url: str):
    redis.Redis.from_url(redis_url).flushdb()
    settings = Settings(data_dir=tmp_path, database_url=sqlite_url(tmp_path), redis_url=redis_url)
    upgrade_to_head(settings.database_url)
    key = new_key(settings.database_url, "alice")
    model = ModelConfig(name=BASE, execution="sequential")
    config = ServerConfig(models=[model], long_poll_seconds=1.0)
    trainer = Trainer(model, str(tmp_path))
    engines = {BASE: {"trainer": trainer, "sampler": Sampler(model, str(tmp_path))}}
    gw = Gateway(settings, config, engines)
    gw.start()
    yield gw, trainer, key
    gw.close()


def _train(tc, steps: int, between=None) -> list[float]:
    losses = []
    for step in range(steps):
        fb = tc.forward_backward(DATA, "cross_entropy")
        opt = tc.optim_step(types.AdamParams(learning_rate=2e-2))
        if between is not None and step == RESTART_AT:
            between()
        losses.append(fb.result().metrics["loss:sum"])
        opt.result()
    return losses


def test_gateway_restart_mid_training_keeps_losses(env):
    gw, trainer, key = env
    url = f"http://127.0.0.1:{gw.port}"
    sc = tinker.ServiceClient(base_url=url, api_key=key)
    solo = sc.create_lora_training_client(base_model=BASE, rank=4, seed=17).result()
    baseline = _train(solo, STEPS)
    restarted = sc.create_lora_training_client(base_model=BASE, rank=4, seed=17).result()

    # Hold `restarted`'s forward_backward inside the Trainer while the gateway restarts.
    gate, entered = threading.Event(), threading.Event()
    gate.set()
    real = trainer.backend.forward_backward

    def gated(adapter_id, inp):
        if adapter_id == restarted.model_id and not gate.is_set():
            entered.set()
            gate.wait(60)
        return real(adapter_id, inp)

    trainer.backend.forward_backward = gated
    replays_before = trainer._once.replays

    def restart() -> None:
        gate.clear()
        assert entered.wait(30), "forward_backward never reached the Trainer"
        # the optim_step is submitted and waits for its seq_id turn (polled, not slept: a loaded
        # host may take longer than any fixed pause to submit it)
        old = services_of(gw.apps[-1]).futures
        deadline = time.monotonic() + 30
        while True:
            pending = [r for r in old._futures.values() if not r.done.is_set()]
            if len(pending) >= 2 or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert len(pending) >= 2, "the restart should interrupt pending futures"
        gw.stop()  # its tasks are cancelled; the Trainer's work goes on (shielded)
        gw.start()
        gate.set()

    losses = _train(restarted, STEPS, between=restart)
    sc.close("success")
    np.testing.assert_allclose(losses, baseline, rtol=0, atol=1e-6)
    assert baseline[-1] < baseline[0]
    new = services_of(gw.apps[-1]).futures
    assert new.takeovers >= 2  # the held forward_backward and the optim_step behind it
    assert trainer._once.replays - replays_before >= 2  # answered from the first execution
