"""The gateway's engine seam: replica choice (rendezvous hashing by model id / session) and the
typed facades (every call names its model id; what they send binds to the deployments' own
signatures; no method-name string entry point is left)."""

from __future__ import annotations

import ast
import asyncio
import inspect
from collections import Counter
from pathlib import Path

import pytest

from engine.protocol import (
    AdamParams,
    CustomLossGraph,
    ForwardBackwardInput,
    LoraSpec,
    SampleInput,
)
from gateway.engine_client import EngineClient, pick_replica


def test_same_key_same_replica_and_keys_spread():
    keys = [f"session-{i}" for i in range(2000)]
    first = [pick_replica(4, k) for k in keys]
    assert first == [pick_replica(4, k) for k in keys]
    counts = Counter(first)
    assert set(counts) == {0, 1, 2, 3} and min(counts.values()) > 400  # ~500 each


def test_adding_a_replica_moves_only_the_keys_it_takes():
    keys = [f"model-{i}" for i in range(2000)]
    moved = [k for k in keys if pick_replica(4, k) != pick_replica(5, k)]
    assert all(pick_replica(5, k) == 4 for k in moved)  # keys only move to the new replica
    assert 250 < len(moved) < 550  # about 1/5 of them


def test_no_key_and_single_replica():
    assert pick_replica(1, "x") == 0 and pick_replica(1, None) == 0
    assert {pick_replica(3, None) for _ in range(200)} == {0, 1, 2}


class _Recorder:
    """An in-process replica stand-in: every method records (replica, method, args, kwargs)."""

    def __init__(self, name: str, log: list) -> None:
        self.name, self.log = name, log

    def __getattr__(self, method: str):
        if method == "sample_stream":

            async def stream(*args, **kwargs):
                self.log.append((self.name, method, args, kwargs))
                yield self.name

            return stream

        async def call(*args, **kwargs):
            self.log.append((self.name, method, args, kwargs))
            return self.name

        return call


SPEC, ADAM = LoraSpec(rank=4), AdamParams()
FB = ForwardBackwardInput(data=[])
#: one call of every Trainer facade method that is about a model, by method name
ABOUT_A_MODEL = {
    "status": lambda t, m: t.status(m, seq_id=1),
    "create_adapter": lambda t, m: t.create_adapter(m, spec=SPEC, tenant="7"),
    "forward_backward": lambda t, m: t.forward_backward(m, seq_id=1, inp=FB),
    "optim_step": lambda t, m: t.optim_step(m, seq_id=2, params=ADAM),
    "skip": lambda t, m: t.skip(m, seq_id=3),
    "save_state": lambda t, m: t.save_state(
        m, seq_id=4, directory="d", include_optimizer=True, age_recipients=["age1x"]
    ),
    "load_state": lambda t, m: t.load_state(
        m, seq_id=None, directory="d", include_optimizer=False, tenant="7"
    ),
    "delete_adapter": lambda t, m: t.delete_adapter(m),
    "native_create": lambda t, m: t.native_create(m, tenant="7"),
    "native_call": lambda t, m: t.native_call(
        m, tenant="7", method="step", adapter_name="a", kwargs={}
    ),
    "native_adapters": lambda t, m: t.native_adapters(m, tenant="7"),
    "native_close": lambda t, m: t.native_close(m, tenant="7"),
}


def _client(n: int, log: list) -> EngineClient:
    trainers = [_Recorder(f"t{i}", log) for i in range(n)]
    samplers = [_Recorder(f"s{i}", log) for i in range(n)]
    return EngineClient({"m": {"trainer": trainers, "sampler": samplers}}, ray_handles=False)


def test_every_trainer_call_about_a_model_reaches_that_models_replica():
    log: list = []
    client = _client(4, log)
    models = [f"sess-{i}:train:0" for i in range(12)]

    async def main():
        for model in models:
            for call in ABOUT_A_MODEL.values():
                await call(client.trainer("m"), model)

    asyncio.run(main())
    assert {m for _, m, _, _ in log} == set(ABOUT_A_MODEL)
    for replica, _, args, _ in log:
        assert replica == f"t{pick_replica(4, args[0])}"  # args[0]: the model id, named
    assert len({r for r, *_ in log}) > 1  # the models spread over the replicas


def test_facade_calls_bind_to_the_deployments_own_signatures():
    """What the facades send is what the Trainer and Sampler methods of the same name accept."""
    from engine.sampler import Sampler
    from engine.trainer import Trainer

    log: list = []
    client = _client(1, log)
    sampler = client.sampler("m")
    inp = SampleInput(prompt_tokens=[1, 2])

    async def main():
        for call in ABOUT_A_MODEL.values():
            await call(client.trainer("m"), "model-a")
        await client.trainer("m").info()
        await client.trainer("m").check_custom_loss(CustomLossGraph("l", (), ()))
        await sampler.sample(inp)
        assert [d async for d in sampler.sample_stream(inp)] == ["s0"]
        await sampler.encode_chat([{"role": "user", "content": "hi"}])
        await sampler.encode_chat_images([], image_fields=["image"], add_generation_prompt=False)
        await sampler.encode_text("hi")
        await sampler.decode([1])
        await sampler.decode_pieces([1])
        await sampler.eos_token()
        await sampler.stats()

    asyncio.run(main())
    for replica, method, args, kwargs in log:
        cls = Trainer if replica.startswith("t") else Sampler
        inspect.signature(getattr(cls, method)).bind(None, *args, **kwargs)


def test_the_string_method_entry_points_are_gone():
    client = _client(2, [])
    assert list(inspect.signature(client.trainer).parameters) == ["base_model"]
    assert list(inspect.signature(client.sampler).parameters) == ["base_model", "affinity"]
    with pytest.raises(TypeError):
        client.trainer("m", "forward_backward", "model-a", 1)  # type: ignore[call-arg]
    for gone in ("trainer_all", "sampler_all", "sampler_stream"):
        assert not hasattr(client, gone)


def test_no_gateway_module_reaches_the_transport_by_method_name():
    """Only gateway/engine_client/ names engine methods: elsewhere, no call of the client's
    private transport (``_call``, ``_trainer_call``, ``_stream``, ``_sampler_target``)."""
    root = Path(__file__).resolve().parents[2] / "gateway"
    private = {"_call", "_trainer_call", "_stream", "_sampler_target"}
    offenders = []
    for path in root.rglob("*.py"):
        if path.parent.name == "engine_client":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in private:
                offenders.append(f"{path.relative_to(root)}:{node.lineno}")
    assert offenders == []


def test_engine_client_routes_by_model_id_and_affinity():
    log: list = []
    client = _client(2, log)

    async def main():
        t = [await client.trainer("m").status(f"run-{i}", seq_id=1) for i in range(20)]
        for i in range(20):
            await client.trainer("m").skip(f"run-{i}", seq_id=7)
        again = [r for r, m, *_ in log if m == "skip"]
        s = [await client.sampler("m", affinity="sess-1").stats() for _ in range(10)]
        every = await client.every_trainer("m").stats()
        return t, again, s, every

    t, again, s, every = asyncio.run(main())
    assert t == again and set(t) == {"t0", "t1"}
    assert len(set(s)) == 1
    assert every == ["t0", "t1"]
