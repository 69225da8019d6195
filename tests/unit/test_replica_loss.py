"""A dead Trainer replica fails its models' calls at once (gateway/engine_client/replica_loss.py).

Ray Serve retries a call that had not reached a replica when that replica died on the replica
Serve starts next, so without `ReplicaLoss` a step submitted just after a kill waits for the
restart (36 s on a loaded CI host) to be told its adapter is gone. Here a Serve handle stand-in
holds calls (as Serve's router does while it waits for a replica) and raises Ray's real
actor-death errors.
"""

from __future__ import annotations

import asyncio
import time

import pytest
from ray.exceptions import ActorDiedError, ActorUnavailableError

from engine.errors import ReplicaLostError
from engine.protocol import AdamParams, ForwardBackwardInput, LoraSpec
from gateway.engine_client import EngineClient, pick_replica, replica_loss
from gateway.futures.kv import MemoryKV

SPEC, ADAM, FB = LoraSpec(rank=4), AdamParams(), ForwardBackwardInput(data=[])
CALL = {"tenant": "u", "method": "forward", "adapter_name": "lora", "kwargs": {}}


class _Replica:
    """A Serve handle stand-in: ``fail[model] = exc`` makes calls about ``model`` raise ``exc``;
    ``hold`` keeps every other call waiting until released. ``calls`` records what arrived."""

    def __init__(self) -> None:
        self.fail: dict[str, BaseException] = {}
        self.hold = False
        self.release = asyncio.Event()
        self.calls: list[tuple[str, str]] = []
        self.cancelled: list[tuple[str, str]] = []

    def __getattr__(self, method: str):
        replica = self

        class _Method:
            def remote(self, model: str, *args, **kwargs):
                async def run():
                    replica.calls.append((method, model))
                    if model in replica.fail:
                        raise replica.fail[model]
                    if replica.hold:
                        try:
                            await replica.release.wait()
                        except asyncio.CancelledError:
                            replica.cancelled.append((method, model))
                            raise
                    return f"{method}:{model}"

                return run()

        return _Method()


async def _soon(coro, within_s: float = 2.0):
    t0 = time.monotonic()
    try:
        return await asyncio.wait_for(coro, within_s)
    finally:
        assert time.monotonic() - t0 < within_s


def test_calls_waiting_on_a_replica_that_died_fail_at_once_and_later_ones_never_reach_it() -> None:
    async def main() -> None:
        replica = _Replica()
        client = EngineClient({"m": {"trainer": replica}}, ray_handles=True)
        await client.trainer("m").create_adapter("model-a", spec=SPEC)
        assert replica.calls == [("create_adapter", "model-a")]
        replica.hold = True  # waiting, as in Serve's router while the replica is being replaced
        waiting = asyncio.ensure_future(
            client.trainer("m").optim_step("model-a", seq_id=2, params=ADAM)
        )
        await asyncio.sleep(0.05)
        assert not waiting.done()
        replica.fail["model-a"] = ActorDiedError()
        with pytest.raises(ReplicaLostError, match="load your last checkpoint"):
            await _soon(client.trainer("m").forward_backward("model-a", seq_id=3, inp=FB))
        with pytest.raises(ReplicaLostError, match="optim_step"):
            await _soon(waiting)
        assert replica.cancelled == [("optim_step", "model-a")]  # not left queued in Serve
        n = len(replica.calls)
        with pytest.raises(ReplicaLostError, match="save_state"):
            await _soon(
                client.trainer("m").save_state(
                    "model-a", seq_id=4, directory="ckpt", include_optimizer=False
                )
            )
        assert len(replica.calls) == n  # failed here, without waiting for the new replica

        # the new replica serves models made after the death, and a remade native model
        replica.hold = False
        del replica.fail["model-a"]
        await client.trainer("m").create_adapter("model-b", spec=SPEC)
        assert replica.calls[-1] == ("create_adapter", "model-b")
        assert await client.trainer("m").forward_backward("model-b", seq_id=0, inp=FB) == (
            "forward_backward:model-b"
        )
        native = "sess-1:tw-0123abcd"
        await client.trainer("m").native_create(native, tenant="u")
        replica.fail[native] = ActorDiedError()
        with pytest.raises(ReplicaLostError):
            await client.trainer("m").native_call(native, **CALL)
        del replica.fail[native]
        assert (
            await client.trainer("m").native_create(native, tenant="u") == f"native_create:{native}"
        )
        assert await client.trainer("m").native_call(f"{native}:lora", **CALL) == (
            f"native_call:{native}:lora"
        )
        # cleanup of a lost model still reaches the engine (nothing to fail fast there)
        await client.trainer("m").delete_adapter("model-a")
        assert replica.calls[-1] == ("delete_adapter", "model-a")

    asyncio.run(main())


def test_an_unreachable_replica_is_not_a_dead_one() -> None:
    async def main() -> None:
        replica = _Replica()
        client = EngineClient({"m": {"trainer": replica}}, ray_handles=True)
        await client.trainer("m").create_adapter("model-a", spec=SPEC)
        replica.fail["model-a"] = ActorUnavailableError("network blip", None)
        with pytest.raises(ReplicaLostError):
            await client.trainer("m").forward_backward("model-a", seq_id=1, inp=FB)
        del replica.fail["model-a"]
        # the actor may still hold the adapter: the next call goes to it
        assert await client.trainer("m").forward_backward("model-a", seq_id=1, inp=FB) == (
            "forward_backward:model-a"
        )

    asyncio.run(main())


def test_a_death_fails_only_the_models_of_that_replica() -> None:
    async def main() -> None:
        replicas = [_Replica(), _Replica()]
        client = EngineClient({"m": {"trainer": replicas}}, ray_handles=True)
        models = [f"model-{i}" for i in range(20)]
        on = {m: pick_replica(2, m) for m in models}
        a = next(m for m in models if on[m] == 0)
        b = next(m for m in models if on[m] == 1)
        for m in (a, b):
            await client.trainer("m").create_adapter(m, spec=SPEC)
        replicas[0].fail[a] = ActorDiedError()
        with pytest.raises(ReplicaLostError):
            await client.trainer("m").forward_backward(a, seq_id=1, inp=FB)
        assert (
            await client.trainer("m").forward_backward(b, seq_id=1, inp=FB)
            == f"forward_backward:{b}"
        )

    asyncio.run(main())


def test_a_cancelled_call_cancels_its_engine_call() -> None:
    async def main() -> None:
        replica = _Replica()
        client = EngineClient({"m": {"trainer": replica}}, ray_handles=True)
        replica.hold = True
        call = asyncio.ensure_future(
            client.trainer("m").forward_backward("model-a", seq_id=0, inp=FB)
        )
        await asyncio.sleep(0.05)
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        await asyncio.sleep(0)
        assert replica.cancelled == [("forward_backward", "model-a")]

    asyncio.run(main())


def _died(actor_id: str) -> ActorDiedError:
    err = ActorDiedError()
    err.actor_id = actor_id  # as Ray sets it from the actor's death context
    return err


def test_gateway_replicas_sharing_a_kv_hear_of_each_others_deaths(monkeypatch) -> None:
    monkeypatch.setattr(replica_loss, "POLL_S", 0.05)

    async def main() -> None:
        replica, kv = _Replica(), MemoryKV()
        a = EngineClient({"m": {"trainer": replica}}, ray_handles=True)
        b = EngineClient({"m": {"trainer": replica}}, ray_handles=True)
        for gw in (a, b):
            gw.share_replica_deaths(kv)
        await a.trainer("m").create_adapter("model-a", spec=SPEC)
        await b.trainer("m").forward_backward("model-a", seq_id=0, inp=FB)
        replica.hold = True
        on_b = asyncio.ensure_future(b.trainer("m").forward_backward("model-a", seq_id=1, inp=FB))
        await asyncio.sleep(0.2)  # b's poller has read the baseline and polled a few times
        assert not on_b.done()
        replica.fail["model-a"] = _died("actor-1")
        with pytest.raises(ReplicaLostError):
            await a.trainer("m").optim_step("model-a", seq_id=2, params=ADAM)
        with pytest.raises(ReplicaLostError):  # b saw no error itself: it read a's report
            await _soon(on_b)
        assert ("forward_backward", "model-a") in replica.cancelled
        n = len(replica.calls)
        with pytest.raises(ReplicaLostError):
            await _soon(
                b.trainer("m").save_state(
                    "model-a", seq_id=3, directory="ckpt", include_optimizer=False
                ),
                within_s=0.5,
            )
        assert len(replica.calls) == n
        await a.aclose()

        # the same report read again, by a's and b's new lives, ends nothing
        del replica.fail["model-a"]
        replica.hold = False
        await b.trainer("m").create_adapter("model-b", spec=SPEC)
        replica.hold = True
        waiting = [
            asyncio.ensure_future(gw.trainer("m").optim_step("model-b", seq_id=1, params=ADAM))
            for gw in (a, b)
        ]
        await asyncio.sleep(0.3)
        assert not any(w.done() for w in waiting)
        replica.release.set()
        assert [await w for w in waiting] == ["optim_step:model-b"] * 2

        # a gateway replica started after the death reads it as old news
        c = EngineClient({"m": {"trainer": replica}}, ray_handles=True)
        c.share_replica_deaths(kv)
        replica.release = asyncio.Event()
        late = asyncio.ensure_future(c.trainer("m").forward_backward("model-b", seq_id=2, inp=FB))
        await asyncio.sleep(0.3)
        assert not late.done()
        replica.release.set()
        assert await late == "forward_backward:model-b"

    asyncio.run(main())


def test_calls_made_after_another_gateway_replicas_death_report_are_not_doomed_by_it(
    monkeypatch,
) -> None:
    """Gateway b has seen no death itself and read its life's baseline before the kill; a model
    made through b after a's report (on the new replica) keeps its load_state when b next polls
    that report."""
    monkeypatch.setattr(replica_loss, "POLL_S", 0.05)

    async def main() -> None:
        replica, kv = _Replica(), MemoryKV()
        a = EngineClient({"m": {"trainer": replica}}, ray_handles=True)
        b = EngineClient({"m": {"trainer": replica}}, ray_handles=True)
        for gw in (a, b):
            gw.share_replica_deaths(kv)
        await a.trainer("m").create_adapter("model-a", spec=SPEC)
        replica.hold = True
        on_b = asyncio.ensure_future(b.trainer("m").forward_backward("model-a", seq_id=0, inp=FB))
        await asyncio.sleep(0.2)  # b's poller read the baseline: no death
        replica.release.set()
        await on_b
        replica.hold, replica.release = False, asyncio.Event()
        replica.fail["model-a"] = _died("actor-1")
        with pytest.raises(ReplicaLostError):
            await a.trainer("m").forward_backward("model-a", seq_id=1, inp=FB)
        await a.aclose()  # a's report is published; b saw nothing itself

        # the tenant resumes through b, on the new replica
        await b.trainer("m").create_adapter("model-new", spec=SPEC)
        replica.hold = True
        load = asyncio.ensure_future(
            b.trainer("m").load_state(
                "model-new", seq_id=None, directory="ckpt", include_optimizer=False
            )
        )
        await asyncio.sleep(0.3)  # several polls of the report
        assert not load.done()
        replica.release.set()
        assert await load == "load_state:model-new"
        replica.hold = False
        assert await b.trainer("m").forward_backward("model-new", seq_id=2, inp=FB) == (
            "forward_backward:model-new"
        )
        # and b does know that model-a's state is gone
        with pytest.raises(ReplicaLostError):
            await _soon(b.trainer("m").forward_backward("model-a", seq_id=3, inp=FB), within_s=0.5)

    asyncio.run(main())


def test_a_death_ray_named_no_actor_for_is_not_published(monkeypatch) -> None:
    """Another replica could not tell an unnamed report from the next death's, so none is made;
    the gateway that saw it still fails its own calls."""
    monkeypatch.setattr(replica_loss, "POLL_S", 0.05)

    async def main() -> None:
        replica, kv = _Replica(), MemoryKV()
        a = EngineClient({"m": {"trainer": replica}}, ray_handles=True)
        a.share_replica_deaths(kv)
        await a.trainer("m").create_adapter("model-a", spec=SPEC)
        replica.fail["model-a"] = ActorDiedError()  # no actor id
        with pytest.raises(ReplicaLostError):
            await a.trainer("m").forward_backward("model-a", seq_id=1, inp=FB)
        await a.aclose()
        assert await kv.get("trainer-death:m:0") is None
        with pytest.raises(ReplicaLostError):
            await a.trainer("m").optim_step("model-a", seq_id=2, params=ADAM)
        del replica.fail["model-a"]
        await a.trainer("m").create_adapter("model-b", spec=SPEC)
        replica.fail["model-b"] = _died("actor-2")
        with pytest.raises(ReplicaLostError):
            await a.trainer("m").forward_backward("model-b", seq_id=1, inp=FB)
        await a.aclose()
        actor, _, at = (await kv.get("trainer-death:m:0")).decode().rpartition("@")
        assert actor == "actor-2" and abs(float(at) - time.time()) < 5

    asyncio.run(main())
