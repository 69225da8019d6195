"""Checkpoint storage every replica reaches (engine/storage.py): the storage id the driver writes,
a replica refusing to start on a node whose data dir is not that storage, and a checkpoint one
replica saved loading in another replica of the same storage."""

from __future__ import annotations

import asyncio
import pickle

import numpy as np
import pytest

from engine.app import engine_apps
from engine.config import EngineConfig
from engine.errors import StorageUnreachableError
from engine.protocol import AdamParams, DatumInput, ForwardBackwardInput, LoraSpec
from engine.sampler import Sampler
from engine.storage import ID_FILE, SharedDirStorage
from engine.trainer import Trainer

MOCK = {"name": "twinkle/tiny-chat", "backend": "mock", "sampler_type": "mock"}


def test_storage_id_is_written_once_and_kept(tmp_path) -> None:
    first = SharedDirStorage(tmp_path / "data").ensure_id()
    assert len(first) == 32 and (tmp_path / "data" / ID_FILE).read_text().strip() == first
    assert SharedDirStorage(tmp_path / "data").ensure_id() == first  # the next deploy agrees
    SharedDirStorage(tmp_path / "data").check(first)


def test_a_node_with_its_own_data_dir_is_refused_naming_dir_and_fix(tmp_path) -> None:
    sid = SharedDirStorage(tmp_path / "shared").ensure_id()
    other = tmp_path / "node-b-local"
    for setup in (lambda: None, lambda: SharedDirStorage(other).ensure_id()):
        setup()  # node B: no data dir at all, then one with its own id
        with pytest.raises(StorageUnreachableError) as err:
            SharedDirStorage(other).check(sid)
        msg = str(err.value)
        assert str(other) in msg and sid in msg and "same shared directory" in msg
        assert "TWINKLE_DATA_DIR" in msg
        again = pickle.loads(pickle.dumps(err.value))  # crosses Ray process boundaries
        assert str(again) == msg and again.category == "server"


def test_replicas_refuse_to_start_off_the_storage(tmp_path) -> None:
    sid = SharedDirStorage(tmp_path / "shared").ensure_id()
    with pytest.raises(StorageUnreachableError):
        Trainer(MOCK, str(tmp_path / "elsewhere"), storage_id=sid)
    with pytest.raises(StorageUnreachableError):
        Sampler(MOCK, str(tmp_path / "elsewhere"), storage_id=sid)


def test_engine_apps_give_every_replica_the_storage_id(tmp_path) -> None:
    config = EngineConfig.model_validate(
        {"models": [{**MOCK, "trainer": {"num_replicas": 2}, "sampler": {"num_replicas": 2}}]}
    )
    apps = engine_apps(config, str(tmp_path))
    sid = (tmp_path / ID_FILE).read_text().strip()
    bound = [a for roles in apps.values() for replicas in roles.values() for a in replicas]
    assert len(bound) == 4
    assert all(a._bound_deployment.init_kwargs["storage_id"] == sid for a in bound)


def test_a_checkpoint_saved_by_one_replica_loads_in_another(tmp_path) -> None:
    sid = SharedDirStorage(tmp_path).ensure_id()
    toks = list(range(5, 21))
    inp = ForwardBackwardInput(
        [DatumInput(toks[:-1], {"target_tokens": np.array(toks[1:]), "weights": np.ones(15)})]
    )

    async def run() -> tuple[float, float]:
        a = Trainer(MOCK, str(tmp_path), storage_id=sid)
        b = Trainer(MOCK, str(tmp_path), storage_id=sid)  # "node B", same shared storage
        await a.create_adapter("m", LoraSpec(rank=4, seed=1))
        await a.forward_backward("m", 1, inp)
        await a.optim_step("m", 2, AdamParams(learning_rate=0.1))
        path = str(tmp_path / "checkpoints" / "1" / "run" / "training" / "step2")
        await a.save_state("m", 3, path, include_optimizer=True)
        probe = ForwardBackwardInput(inp.data, forward_only=True)
        want = (await a.forward_backward("m", 4, probe)).metrics
        await b.load_state("m2", None, path, include_optimizer=True)
        got = (await b.forward_backward("m2", 1, probe)).metrics
        return want["loss:sum"], got["loss:sum"]

    want, got = asyncio.run(run())
    assert got == pytest.approx(want)
