"""Native models with two gateway replicas: any replica serves any native call.

A native model's state lives in the Trainer replica that holds its adapters
(engine/native/host.py) and its ownership in the shared KV store (Redis), so a training loop whose
consecutive calls alternate between two gateway replicas gives the same losses as the same loop
against one replica.

Setup (chosen over a two-replica `twinkle serve`, whose proxy picks replicas at random, so a test
could not make calls alternate): two gateway apps, each a real uvicorn HTTP server, sharing one
real redis-server, one SQLite DB and one engine of two in-process Trainer replicas (so routing by
model id matters too), all on one event loop. The client is the unmodified `twinkle_client`; its
transport sends request i to replica i % 2.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import socket
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import redis
import uvicorn

import twinkle_client
from twinkle_client.model import MultiLoraTransformersModel as RemoteModel

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from engine.base_models.registry import resolve_model_dir  # noqa: E402
from engine.config import ModelConfig  # noqa: E402
from engine.trainer import Trainer  # noqa: E402
from gateway.config import ServerConfig  # noqa: E402
from gateway.db import make_engine, session_scope, upgrade_to_head  # noqa: E402
from gateway.engine_client import EngineClient  # noqa: E402
from gateway.main import create_app  # noqa: E402
from gateway.settings import Settings  # noqa: E402
from tests.factories import create_user_and_key  # noqa: E402
from tests.tiny_models import seed_models  # noqa: E402
from tests.twinkle_scripts import BASE, hf_data, roll, sft_script  # noqa: E402

pytestmark = pytest.mark.e2e


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Replicas:
    """Gateway apps served by uvicorn on one event loop thread (the in-process Trainers' asyncio
    state belongs to one loop), one port each."""

    def __init__(self, settings: Settings, config: ServerConfig, engines: dict, n: int) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.ports, self.servers, self.done = [], [], []
        for _ in range(n):
            app = create_app(settings, config, EngineClient(engines, ray_handles=False))
            port = _port()
            cfg = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning")
            server = uvicorn.Server(cfg)
            self.done.append(asyncio.run_coroutine_threadsafe(server.serve(), self.loop))
            self.ports.append(port)
            self.servers.append(server)
        deadline = time.monotonic() + 60
        while not all(s.started for s in self.servers):
            assert time.monotonic() < deadline, "gateway replicas did not start"
            time.sleep(0.05)

    def close(self) -> None:
        for s in self.servers:
            s.should_exit = True
        for d in self.done:
            d.result(timeout=30)

        async def cancel_rest() -> None:  # the Trainers' scheduler loops live on this loop too
            rest = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in rest:
                t.cancel()
            await asyncio.gather(*rest, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(cancel_rest(), self.loop).result(timeout=10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)


class RoundRobin(httpx.BaseTransport):
    """Sends each request to the next replica's port, in turn; counts requests per port."""

    def __init__(self, ports: list[int]) -> None:
        self._next = itertools.cycle(ports)
        self._inner = httpx.HTTPTransport()
        self.sent: dict[int, int] = dict.fromkeys(ports, 0)

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        port = next(self._next)
        self.sent[port] += 1
        request.url = request.url.copy_with(port=port)
        return self._inner.handle_request(request)


@pytest.fixture(scope="module")
def env(tmp_path_factory, redis_url):
    redis.Redis.from_url(redis_url).flushdb()
    data = Path(tmp_path_factory.mktemp("native-replicas"))
    seed_models(data)
    settings = Settings(data_dir=data, database_url=f"sqlite:///{data}/twinkle.db")
    upgrade_to_head(settings.database_url)
    with session_scope(make_engine(settings.database_url)) as s:
        keys = {u: create_user_and_key(s, user_name=u, admin=False) for u in ("alice", "bob")}
    model = ModelConfig(
        name=BASE, execution="sequential", trainer={"num_replicas": 2, "num_cpus": 0.5}
    )
    config = ServerConfig.model_validate(
        {"models": [model.model_dump()], "gateway": {"num_replicas": 2, "redis_url": redis_url}}
    )
    trainers = [Trainer(model, str(data)) for _ in range(2)]
    replicas = Replicas(settings, config, {BASE: {"trainer": trainers, "sampler": []}}, n=2)
    yield replicas, trainers, keys, resolve_model_dir(BASE, data)
    replicas.close()


def _client(ports: list[int], key: str) -> tuple[twinkle_client.TwinkleClient, RoundRobin]:
    transport = RoundRobin(ports)
    url = f"http://127.0.0.1:{ports[0]}"
    client = twinkle_client.TwinkleClient(
        url, key, session_heartbeat_interval=None, transport=transport
    )
    return client, transport


def test_a_loop_alternating_replicas_equals_one_replica(env):
    replicas, trainers, keys, model_dir = env
    key = keys["alice"]
    data = roll(hf_data(model_dir))  # upstream's protocol takes rolled labels
    one, one_t = _client(replicas.ports[:1], key)
    both, both_t = _client(replicas.ports, key)
    single = sft_script(RemoteModel, BASE, data, client=one)
    mixed = sft_script(RemoteModel, BASE, data, client=both)
    # every call alternated: both replicas served about half of the ~60 requests
    counts = list(both_t.sent.values())
    assert min(counts) >= 20 and abs(counts[0] - counts[1]) <= 1, counts
    assert list(one_t.sent.values())[0] == sum(counts)
    # The same operations in the same order on the same CPU: bitwise equal in practice; 1e-6
    # (~1e-6 of a loss near 5) only leaves room for a different BLAS thread split.
    for key_ in ("losses", "norms", "resumed"):
        np.testing.assert_allclose(mixed[key_], single[key_], rtol=0, atol=1e-6, err_msg=key_)
    assert mixed["probe_norm"] == pytest.approx(single["probe_norm"], rel=1e-6)
    assert mixed["resume_info"]["cur_step"] == single["resume_info"]["cur_step"] == 2
    assert mixed["losses"][-1] < mixed["losses"][0]
    # the models' state lives in the Trainers (the replica the model id routes to), not in the
    # gateways: one model per session (each client's session on the base model) hosted there
    hosted = [m for t in trainers for m in t.native.model_ids()]
    assert (
        sorted(hosted)
        == sorted(m for c in (one, both) for m in hosted if m.startswith(c.session_id))
        and len(hosted) == 2
    ), hosted
    one.close()
    both.close()


def test_ownership_is_checked_on_every_replica(env):
    replicas, _, keys, _ = env
    key, bob_key = keys["alice"], keys["bob"]
    alice, _ = _client(replicas.ports, key)
    m = RemoteModel(BASE, client=alice)  # created through replica 0
    m.add_adapter_to_model("owned", {"r": 4})  # served by replica 1
    for port in replicas.ports:  # bob sends alice's session (her model's handle): 404 on either
        bob, _ = _client([port], bob_key)
        bob._http.headers["X-Twinkle-Session-Id"] = alice.session_id
        with pytest.raises(twinkle_client.NotFoundError, match="session"):
            RemoteModel(BASE, client=bob)
        bob.close()
    m.close()  # frees the adapter through one replica; no replica finds it any more
    for port in replicas.ports:
        again, _ = _client([port], key)
        again._http.headers["X-Twinkle-Session-Id"] = alice.session_id
        with pytest.raises(twinkle_client.NotFoundError, match="owned"):
            RemoteModel(BASE, client=again).get_train_configs(adapter_name="owned")
        again.close()
    alice.close()
