"""Errors of faults: a checkpoint written onto a full disk (a real, tiny tmpfs) is a
`StorageFullError` that names the folder and leaves no partial directory; Ray's actor-death errors
become a `ReplicaLostError` telling the client to resume from its last checkpoint."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayTaskError

from engine.backends.checkpoint_io import write_checkpoint_dir
from engine.errors import ReplicaLostError, StorageFullError, UserInputError
from engine.protocol import ForwardBackwardInput
from gateway.engine_client import EngineClient
from tests.e2e.fault_services import mount_tmpfs, unmount

FB = ForwardBackwardInput(data=[])


@pytest.fixture
def tiny_disk(tmp_path: Path):
    disk = tmp_path / "disk"
    why = mount_tmpfs(disk, "256k")
    if why is not None:
        pytest.skip(why)
    yield disk
    unmount(disk)


def test_a_full_disk_is_a_storage_full_error_and_leaves_nothing(tiny_disk: Path) -> None:
    def fill(tmp: Path) -> None:
        (tmp / "adapter_model.safetensors").write_bytes(b"\0" * (1024 * 1024))

    with pytest.raises(StorageFullError, match="checkpoint storage is full") as err:
        write_checkpoint_dir(tiny_disk / "ckpt", fill)
    assert str(tiny_disk) in str(err.value)
    assert list(tiny_disk.iterdir()) == []  # the partial temp dir is gone, nothing listed


def test_a_library_error_carrying_enospc_text_is_storage_full(tmp_path: Path) -> None:
    def fill(tmp: Path) -> None:  # safetensors' own error type on ENOSPC carries this text
        raise RuntimeError(
            "Error while serializing: I/O error: No space left on device (os error 28)"
        )

    with pytest.raises(StorageFullError):
        write_checkpoint_dir(tmp_path / "ckpt", fill)
    assert list(tmp_path.iterdir()) == []


def test_other_fill_errors_pass_through(tmp_path: Path) -> None:
    def fill(tmp: Path) -> None:
        raise UserInputError("bad")

    with pytest.raises(UserInputError):
        write_checkpoint_dir(tmp_path / "ckpt", fill)


class _Method:
    def __init__(self, exc: Exception) -> None:
        self.exc = exc

    def remote(self, *args, **kwargs):
        async def fail():
            raise self.exc

        return fail()


class _DeadReplica:
    """A Serve handle stand-in whose calls raise what Ray raises for a dead replica."""

    def __init__(self, exc: Exception) -> None:
        self.exc = exc

    def __getattr__(self, name: str) -> _Method:
        return _Method(self.exc)


@pytest.mark.parametrize("exc", [ActorDiedError(), ActorUnavailableError("gone", None)])
def test_a_dead_replica_is_replica_lost_saying_what_to_do(exc: Exception) -> None:
    client = EngineClient({"m": {"trainer": _DeadReplica(exc)}}, ray_handles=True)
    with pytest.raises(ReplicaLostError) as err:
        asyncio.run(client.trainer("m").forward_backward("model-1", seq_id=3, inp=FB))
    msg = str(err.value)
    assert "forward_backward" in msg and "load your last checkpoint" in msg
    assert err.value.category == "server"


def test_an_engine_error_inside_a_ray_task_error_is_still_unwrapped() -> None:
    wrapped = RayTaskError("f", "tb", UserInputError("data[0]: bad"))
    client = EngineClient({"m": {"trainer": _DeadReplica(wrapped)}}, ray_handles=True)
    with pytest.raises(UserInputError, match="data"):
        asyncio.run(client.trainer("m").forward_backward("model-1", seq_id=3, inp=FB))
