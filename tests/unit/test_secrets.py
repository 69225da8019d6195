"""The gateway's secrets (`gateway.settings.load_secret`): env wins, one file per secret created
once with mode 0600, and replicas racing to create it all read the same value."""

from __future__ import annotations

import multiprocessing as mp
import stat
from pathlib import Path

import pytest

from gateway.settings import SECRETS, Secrets, load_secret


def _load(args: tuple[str, str]) -> bytes:
    name, data_dir = args
    return load_secret(name, Path(data_dir), environ={})


@pytest.mark.parametrize("name", sorted(SECRETS))
def test_env_wins_else_one_private_file(tmp_path: Path, name: str) -> None:
    env_name, rel = SECRETS[name]
    assert load_secret(name, tmp_path, environ={env_name: "from-env"}) == b"from-env"
    assert not (tmp_path / rel).exists()  # the variable never writes a file
    first = load_secret(name, tmp_path, environ={})
    assert len(first) >= 48 and load_secret(name, tmp_path, environ={}) == first
    assert stat.S_IMODE((tmp_path / rel).stat().st_mode) == 0o600
    assert [p.name for p in (tmp_path / rel).parent.iterdir() if "tmp" in p.name] == []


def test_racing_replicas_read_one_secret(tmp_path: Path) -> None:
    with mp.get_context("spawn").Pool(4) as pool:
        got = pool.map(_load, [("url_signing", str(tmp_path))] * 16)
    assert len(set(got)) == 1


def test_secrets_differ_by_name(tmp_path: Path) -> None:
    s = Secrets.load(tmp_path, environ={})
    assert s.jwt != s.url_signing and s == Secrets.load(tmp_path, environ={})
