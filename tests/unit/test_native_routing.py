"""Native-model names (engine/rules.py) and how the gateway routes them: a native model's
adapter runs reach the Trainer replica that hosts the model (engine/native/host.py)."""

from __future__ import annotations

import asyncio

from engine.rules import NATIVE_MODEL_METHODS, native_model_id, native_run_id, trainer_route_key
from gateway.engine_client import EngineClient, pick_replica


class _Echo:
    def __init__(self, name: str) -> None:
        self.name = name

    async def status(self, model_id: str, seq_id: int) -> dict:
        return {"replica": self.name}


def test_native_runs_route_with_their_model_and_nothing_else_moves():
    mid = native_model_id("sess-0123456789abcdef", "0a1b2c3d")
    assert mid == "sess-0123456789abcdef:tw-0a1b2c3d"
    for adapter in ("default", "dpo", "a.b-c_1"):
        assert trainer_route_key(native_run_id(mid, adapter)) == mid
    assert trainer_route_key(mid) == mid
    others = ("sess-1:train:0", "run-3", "sess-1:tw-nothex12:x", "sess-1:tw-0a1b2c3d:a:b")
    for other in (*others, f"{mid}:a\n"):  # a name is matched whole: no trailing newline
        assert trainer_route_key(other) == other


def test_engine_client_sends_a_native_run_to_its_models_replica():
    trainers = [_Echo(f"t{i}") for i in range(4)]
    client = EngineClient({"m": {"trainer": trainers, "sampler": []}}, ray_handles=False)
    ids = [native_model_id(f"sess-{i}", f"{i:08x}") for i in range(40)]

    async def run():
        for mid in ids:
            want = f"t{pick_replica(4, mid)}"
            trainer = client.trainer("m")
            assert (await trainer.status(mid, seq_id=0))["replica"] == want
            run = native_run_id(mid, "default")
            assert (await trainer.status(run, seq_id=0))["replica"] == want

    asyncio.run(run())
    assert len({pick_replica(4, m) for m in ids}) > 1  # the models spread over the replicas


def test_native_methods_are_methods_of_the_engine_class():
    from engine.local.model import MultiLoraTransformersModel

    for name in NATIVE_MODEL_METHODS:
        assert callable(getattr(MultiLoraTransformersModel, name, None)), name
