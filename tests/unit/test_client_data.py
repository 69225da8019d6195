"""twinkle_client's data toolkit without a server: Dataset loading and preprocessors (upstream's
calls too), the DataLoader's batching / state / resume, argument serialization. Encoding through
the server is covered in test_client_protocol.py."""

from __future__ import annotations

import csv
import json

import numpy as np
import pytest

from twinkle_client import InvalidRequestError
from twinkle_client._serialize import lora_config_dict, lora_config_json, name_of, to_wire
from twinkle_client.dataloader import DataLoader
from twinkle_client.dataset import Dataset, DatasetError, DatasetMeta, dpo_batch
from twinkle_client.preprocessor import MathProcessor, SelfCognitionProcessor

ROWS = [
    {"query": "Who are you?", "response": "I am {{NAME}}, made by {{AUTHOR}}."},
    {"query": "What is your name?", "response": "{{NAME}}."},
    {"query": None, "response": "dropped"},
]


@pytest.fixture
def files(tmp_path):
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps(r) for r in ROWS) + "\n")
    (tmp_path / "d.json").write_text(json.dumps({"data": ROWS}))
    with (tmp_path / "d.csv").open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["query", "response"])
        w.writeheader()
        w.writerows(ROWS[:2])
    return tmp_path


def test_local_formats_load_the_same_rows(files):
    a = Dataset(str(files / "d.jsonl"))
    b = Dataset(DatasetMeta(str(files / "d.json")))
    c = Dataset(DatasetMeta(str(files / "d.csv"), data_slice=range(2)))
    assert a.rows == b.rows == ROWS and c.rows == ROWS[:2]
    assert len(Dataset(DatasetMeta(str(files / "d.jsonl"), data_slice=range(1)))) == 1


def test_unreadable_sources_give_clear_errors(files, tmp_path):
    with pytest.raises(DatasetError, match="no such file"):
        Dataset(str(tmp_path / "missing.jsonl"))
    (tmp_path / "x.txt").write_text("hi")
    with pytest.raises(DatasetError, match="unsupported format .txt"):
        Dataset(str(tmp_path / "x.txt"))
    try:
        import pyarrow  # noqa: F401
    except ImportError:
        (tmp_path / "x.parquet").write_bytes(b"PAR1")
        with pytest.raises(DatasetError, match="pyarrow"):
            Dataset(str(tmp_path / "x.parquet"))
    # no hub library / no hub reachable here: the error says what to do instead
    for dataset_id in ("ms://swift/self-cognition", "hf://org/name"):
        with pytest.raises(DatasetError, match="local file path") as e:
            Dataset(DatasetMeta(dataset_id))
        assert dataset_id in str(e.value)


def test_preprocessors_by_name_and_callable(files):
    ds = Dataset(str(files / "d.jsonl")).map(
        "SelfCognitionProcessor", init_args={"model_name": "Twinkle", "model_author": "Team T"}
    )
    assert len(ds) == 2  # the malformed row is dropped
    assert ds[0]["messages"] == [
        {"role": "user", "content": "Who are you?"},
        {"role": "assistant", "content": "I am Twinkle, made by Team T."},
    ]
    dpo = Dataset([{"prompt": "p", "chosen": "good", "rejected": "bad"}]).map("DPOProcessor")
    assert dpo[0]["chosen"]["messages"][-1]["content"] == "good"
    assert dpo[0]["rejected"]["messages"][-1]["content"] == "bad"
    assert dpo_batch([{"chosen": 1, "rejected": 2}, {"chosen": 3, "rejected": 4}]) == [1, 2, 3, 4]
    math = Dataset([{"question": "1+1?", "answer": "It is 2.\n#### 2"}]).map(MathProcessor())
    assert math[0]["ground_truth"] == "2" and math[0]["messages"][-1]["role"] == "user"
    doubled = Dataset([{"a": 1}]).map(lambda r: [r, r])
    assert len(doubled) == 2
    with pytest.raises(DatasetError, match="unknown 'Nope'"):
        Dataset([{"a": 1}]).map("Nope")


def test_dataloader_batches_state_and_resume():
    data = [{"i": i} for i in range(10)]
    dl = DataLoader(data, batch_size=4, shuffle=True, seed=3)
    assert len(dl) == 3
    epoch0 = [[r["i"] for r in b] for b in dl]
    assert sorted(i for b in epoch0 for i in b) == list(range(10)) and [len(b) for b in epoch0] == [
        4,
        4,
        2,
    ]
    epoch1 = [[r["i"] for r in b] for b in dl]
    assert epoch1 != epoch0  # a new order each epoch
    # interrupt after one batch of epoch 1, then resume from the saved state
    dl2 = DataLoader(data, batch_size=4, shuffle=True, seed=3)
    list(dl2)
    it = iter(dl2)
    next(it)
    state = dl2.state_dict()
    dl3 = DataLoader(data, batch_size=4, shuffle=True, seed=3)
    dl3.load_state_dict(state)
    assert [[r["i"] for r in b] for b in dl3] == epoch1[1:]
    # consumed_train_samples from a model checkpoint: 14 rows = epoch 1, 4 rows in
    dl4 = DataLoader(data, batch_size=4, shuffle=True, seed=3)
    dl4.resume_from_checkpoint(14)
    assert [[r["i"] for r in b] for b in dl4] == epoch1[1:]
    assert len(DataLoader(data, batch_size=4, drop_last=True)) == 2
    with pytest.raises(ValueError, match="batch_size"):
        DataLoader(data, batch_size=0)


def test_serialization_of_arguments():
    class LoraConfig:  # peft-like: public attributes, a set, an enum-like str, a private one
        def __init__(self):
            self.r, self.target_modules, self.lora_dropout = 8, {"v_proj", "q_proj"}, 0.0
            self._private, self.runtime = 1, object()  # what JSON cannot carry is dropped

    assert lora_config_dict(LoraConfig()) == {
        "r": 8,
        "target_modules": ["q_proj", "v_proj"],
        "lora_dropout": 0.0,
    }
    assert json.loads(lora_config_json(LoraConfig()) or "") == {
        "r": 8,
        "target_modules": ["q_proj", "v_proj"],
        "lora_dropout": 0.0,
        "_TWINKLE_TYPE_": "LoraConfig",
    }
    assert json.loads(lora_config_json({"r": 4}) or "") == {"r": 4}
    assert lora_config_json(None) is None
    assert to_wire({"x": np.arange(3), "y": (np.float32(1.5),)}) == {"x": [0, 1, 2], "y": [1.5]}

    class CrossEntropyLoss:
        pass

    assert name_of(CrossEntropyLoss, "loss") == name_of(CrossEntropyLoss(), "loss")
    assert name_of("DPOLoss", "loss") == "DPOLoss"
    with pytest.raises(InvalidRequestError, match="cannot be sent"):
        to_wire({"fn": lambda x: x})


def test_upstream_style_dataset_calls(files):
    path = str(files / "d.jsonl")
    ds = Dataset(dataset_meta=DatasetMeta(path, subset_name="default", split="train"))
    assert len(ds) == 3
    assert len(Dataset(dataset_id=path, data_slice=range(2))) == 2  # DatasetMeta's fields
    assert Dataset(DatasetMeta(data={"a": [1, 2]})).rows == [{"a": 1}, {"a": 2}]
    with pytest.raises(DatasetError, match="model_id is required"):
        ds.set_template("Qwen3_5Template", max_length=16)
    with pytest.raises(DatasetError, match="no template"):
        ds.encode(batched=True)
    ds.map(SelfCognitionProcessor, init_args={"model_name": "A", "model_author": "B"})
    assert ds[0]["messages"][-1]["content"] == "I am A, made by B."
    pairs = dpo_batch([{"id": 7, "positive": {"input_ids": [1]}, "negative": {"input_ids": [2]}}])
    assert pairs == [{"id": 7, "input_ids": [1]}, {"id": 7, "input_ids": [2]}]


def test_dataloader_get_state_counts_all_epochs():
    data = [{"i": i} for i in range(10)]
    dl = DataLoader(dataset=lambda: data, batch_size=4, num_workers=0)
    list(dl)
    next(iter(dl))
    assert dl.get_state() == {"consumed_train_samples": 14} and len(dl) == 3
    again = DataLoader(data, batch_size=4)
    again.resume_from_checkpoint(dl.get_state()["consumed_train_samples"])
    assert (again.epoch, again.consumed) == (1, 4)
    again.load_state_dict({"consumed_train_samples": 3})
    assert (again.epoch, again.consumed) == (0, 3)


def test_public_surface_imports_without_torch():
    import subprocess
    import sys

    code = (
        "import sys, twinkle_client\n"
        "from twinkle_client import model, sampler, dataset, dataloader, template, types\n"
        "from twinkle_client import preprocessor, rollout\n"
        "missing = [n for n in twinkle_client.__all__ if not hasattr(twinkle_client, n)]\n"
        "assert not missing, missing\n"
        "heavy = [m for m in ('torch', 'transformers', 'tinker', 'engine', 'gateway')\n"
        "         if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
