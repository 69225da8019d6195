"""Checkpoints saved through the native API record numbers in user_metadata; the Tinker SDK types
it ``dict[str, str]`` and refuses a whole listing with one bad value. Our Tinker schemas send
strings (JSON text for anything else)."""

from __future__ import annotations

from tinker import types

from gateway.tinker_api.schemas import Checkpoint, TrainingRun


def _checkpoint(meta) -> dict:
    return {
        "checkpoint_id": "weights/x",
        "checkpoint_type": "training",
        "time": "2026-12-04T00:00:00Z",
        "tinker_path": "tinker://run/weights/x",
        "size_bytes": 10,
        "public": False,
        "user_metadata": meta,
        "expires_at": None,
    }


def test_non_string_metadata_reaches_the_sdk_as_strings() -> None:
    meta = {"consumed_train_samples": 4, "lr": 0.5, "tags": ["a"], "name": "n", "none": None}
    out = Checkpoint(**_checkpoint(meta)).model_dump()
    assert out["user_metadata"] == {
        "consumed_train_samples": "4",
        "lr": "0.5",
        "tags": '["a"]',
        "name": "n",
        "none": "null",
    }
    types.Checkpoint.model_validate(out)  # what the SDK parses
    assert Checkpoint(**_checkpoint(None)).user_metadata is None
    run = TrainingRun(
        training_run_id="run",
        base_model="m",
        model_owner="u",
        is_lora=True,
        corrupted=False,
        lora_rank=8,
        last_request_time="2026-12-04T00:00:00Z",
        last_checkpoint=Checkpoint(**_checkpoint(meta)),
        last_sampler_checkpoint=None,
        user_metadata={"step": 3},
    )
    types.TrainingRun.model_validate(run.model_dump())
