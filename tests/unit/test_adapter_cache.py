"""engine/backends/adapter_cache.py: the samplers' stat-keyed LRU of adapter directories."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from engine.backends.adapter_cache import WEIGHTS_FILE, AdapterDirCache
from engine.errors import CheckpointError


def _adapter(root: Path, name: str, payload: bytes = b"w") -> str:
    d = root / name
    d.mkdir(exist_ok=True)
    (d / WEIGHTS_FILE).write_bytes(payload)
    return str(d)


def test_weights_file_is_the_peft_one() -> None:
    from engine.backends.peft_files import ADAPTER_WEIGHTS_NAME

    assert WEIGHTS_FILE == ADAPTER_WEIGHTS_NAME


def test_hit_miss_rewrite_and_lru(tmp_path: Path) -> None:
    cache: AdapterDirCache[str] = AdapterDirCache(capacity=2)
    loads, dropped = [], []

    def load(path: str) -> str:
        loads.append(path)
        return f"id{len(loads)}"

    a, b, c = (_adapter(tmp_path, n) for n in "abc")
    assert cache.get(a, load, dropped.append) == "id1"
    assert cache.get(a, load, dropped.append) == "id1"  # hit: no load
    os.symlink(a, tmp_path / "link")
    assert cache.get(str(tmp_path / "link"), load, dropped.append) == "id1"  # same realpath
    assert cache.get(b, load, dropped.append) == "id2"
    # rewritten in place (another size): the stale entry is dropped, the new file loaded
    _adapter(tmp_path, "a", b"new weights")
    assert cache.get(a, load, dropped.append) == "id3" and dropped == ["id1"]
    assert cache.dirs() == [os.path.realpath(b), os.path.realpath(a)]  # LRU first
    cache.get(c, load, dropped.append)
    assert len(cache) == 3  # get never evicts
    cache.trim(dropped.append, keep=lambda v: v == "id2")  # b is in use: a goes instead
    assert dropped == ["id1", "id3"] and cache.dirs() == [os.path.realpath(p) for p in (b, c)]


def test_missing_or_failing_load_caches_nothing(tmp_path: Path) -> None:
    cache: AdapterDirCache[str] = AdapterDirCache(capacity=4)
    with pytest.raises(CheckpointError, match="not found"):
        cache.get(str(tmp_path / "nope"), str, print)

    def bad(path: str) -> str:
        raise CheckpointError("bad adapter")

    with pytest.raises(CheckpointError, match="bad adapter"):
        cache.get(_adapter(tmp_path, "a"), bad, print)
    assert len(cache) == 0
