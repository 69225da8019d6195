"""Replica choice of the gateway's EngineClient: rendezvous hashing by model id / session."""

from __future__ import annotations

import asyncio
from collections import Counter

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


class _Echo:
    def __init__(self, name: str) -> None:
        self.name = name

    async def whoami(self, *args):
        return self.name


def test_engine_client_routes_by_model_id_and_affinity():
    client = EngineClient(
        {"m": {"trainer": [_Echo("t0"), _Echo("t1")], "sampler": [_Echo("s0"), _Echo("s1")]}},
        ray_handles=False,
    )

    async def main():
        t = [await client.trainer("m", "whoami", f"run-{i}", 1) for i in range(20)]
        again = [await client.trainer("m", "whoami", f"run-{i}", 7) for i in range(20)]
        s = [await client.sampler("m", "whoami", affinity="sess-1") for _ in range(10)]
        every = await client.trainer_all("m", "whoami")
        return t, again, s, every

    t, again, s, every = asyncio.run(main())
    assert t == again and set(t) == {"t0", "t1"}
    assert len(set(s)) == 1
    assert every == ["t0", "t1"]
