"""``twinkle keys`` (gateway.cli.keys.keys_main) against a data dir in tmp_path, plus Settings."""

from __future__ import annotations

import base64
from pathlib import Path

import pytest
from sqlmodel import Session

from gateway.accounts.keys import authenticate
from gateway.cli.keys import keys_main
from gateway.db import make_engine
from gateway.errors import AuthenticationError
from gateway.settings import Settings


@pytest.fixture
def data_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("TWINKLE_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.delenv("TWINKLE_DATABASE_URL", raising=False)
    return tmp_path / "data"


def _create(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    assert keys_main(["create", *args]) == 0
    out, err = capsys.readouterr()
    lines = out.splitlines()
    assert len(lines) == 1, out
    key = lines[0]
    assert key not in err and key[:10] in err
    return key


def _auth(key: str):
    engine = make_engine(Settings.from_env().database_url)
    try:
        with Session(engine) as session:
            return authenticate(session, key)
    finally:
        engine.dispose()


def test_create_prints_only_a_working_key(
    data_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    key = _create(capsys, "--user", "alice")
    assert key.startswith("tml-")
    raw = base64.urlsafe_b64decode(key[4:] + "=" * (-len(key[4:]) % 4))
    assert len(raw) >= 32
    assert (data_dir / "twinkle.db").exists()
    principal = _auth(key)
    assert (principal.user_name, principal.scope) == ("alice", "user")


def test_create_admin_and_second_key_for_same_user(
    data_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    k1 = _create(capsys, "--user", "alice")
    k2 = _create(capsys, "--user", "alice", "--admin")
    p1, p2 = _auth(k1), _auth(k2)
    assert p1.user_id == p2.user_id and p2.scope == "admin" and p1.key_id != p2.key_id


def test_list_and_revoke(data_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    key = _create(capsys, "--user", "alice")
    other = _create(capsys, "--user", "bob", "--admin")
    assert keys_main(["list"]) == 0
    out, _ = capsys.readouterr()
    assert "PREFIX" in out and key[:10] in out and other[:10] in out and "bob" in out
    assert key not in out and key[10:] not in out

    assert keys_main(["revoke", key[:10]]) == 0
    with pytest.raises(AuthenticationError):
        _auth(key)
    assert _auth(other).user_name == "bob"
    assert keys_main(["list"]) == 0
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith(key[:10]))
    assert line.split()[-1] != "-"  # revoked timestamp shown

    assert keys_main(["revoke", key[:10]]) == 0  # already revoked: still fine
    assert keys_main(["revoke", "tml-nope00"]) == 1
    assert keys_main(["revoke", other]) == 0  # a full key also works
    with pytest.raises(AuthenticationError):
        _auth(other)


def test_usage_errors_return_codes(data_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert keys_main([]) == 2
    assert keys_main(["create"]) == 2
    assert keys_main(["--help"]) == 0
    assert keys_main(["create", "--user", "   "]) == 1
    capsys.readouterr()


def test_create_while_a_server_engine_is_open(
    data_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _create(capsys, "--user", "first")  # migrates the fresh data dir
    server = make_engine(Settings.from_env().database_url)  # the "serve" process's engine
    try:
        with Session(server) as session:
            session.connection()  # holds a connection open
            key = _create(capsys, "--user", "late")
            assert authenticate(session, key).user_name == "late"
    finally:
        server.dispose()


def test_settings_from_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    s = Settings.from_env({})
    assert s.data_dir == (tmp_path / ".twinkle").resolve() and s.data_dir.is_absolute()
    assert s.database_url == f"sqlite:///{(tmp_path / '.twinkle' / 'twinkle.db').resolve()}"
    s = Settings.from_env({"TWINKLE_DATA_DIR": "rel", "TWINKLE_DATABASE_URL": "postgresql://h/db"})
    assert s.data_dir == (tmp_path / "rel").resolve()
    assert s.database_url == "postgresql://h/db"


def test_create_in_an_org_with_expiry_and_the_orgs_and_quotas_commands(
    data_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from gateway.cli.orgs import orgs_main

    key = _create(
        capsys, "--user", "alice", "--org", "acme", "--name", "laptop", "--expires-in", "3600"
    )
    principal = _auth(key)
    assert principal.org_name == "acme" and principal.org_id is not None
    assert keys_main(["list"]) == 0
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith(key[:10]))
    assert "acme" in line.split() and line.split()[5] != "-"  # org and expiry shown
    # a user stays in its organization
    assert keys_main(["create", "--user", "alice", "--org", "other"]) == 1
    assert orgs_main(["list"]) == 0
    assert "acme\tactive" in capsys.readouterr().out
    assert orgs_main(["disable", "acme"]) == 0
    with pytest.raises(AuthenticationError):
        _auth(key)
    assert orgs_main(["enable", "acme"]) == 0
    assert _auth(key).user_name == "alice"
    capsys.readouterr()
    assert orgs_main(["max_training_clients=2"], "quotas") == 2  # usage error
    assert (
        orgs_main(["set", "--org", "acme", "max_training_clients=2", "max_lora_rank=8"], "quotas")
        == 0
    )
    assert capsys.readouterr().out.split() == ["max_lora_rank=8", "max_training_clients=2"]
    assert orgs_main(["set", "--user", "alice", "bogus=1"], "quotas") == 1
    assert "bogus" in capsys.readouterr().err
    assert orgs_main(["set", "--org", "acme", "max_lora_rank=none"], "quotas") == 0
    assert capsys.readouterr().out.split() == ["max_training_clients=2"]
