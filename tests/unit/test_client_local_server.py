"""twinkle_client.local_server: a local quick-start server is found with nothing set, and its key
never goes anywhere but the loopback URL written beside it."""

from __future__ import annotations

import json

import pytest

from twinkle_client import local_server
from twinkle_client._client import TwinkleClient, TwinkleError

URL, KEY = "http://127.0.0.1:18000", "tml-local"


@pytest.fixture
def data_dir(tmp_path, monkeypatch):
    for var in ("TWINKLE_SERVER_URL", "TWINKLE_SERVER_TOKEN"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("TWINKLE_DATA_DIR", str(tmp_path))
    return tmp_path


def _write(data_dir, url=URL, key=KEY) -> None:
    (data_dir / local_server.FILE_NAME).write_text(json.dumps({"url": url, "key": key}))


def test_nothing_set_finds_the_local_server(data_dir) -> None:
    _write(data_dir)
    assert local_server.resolve(None, None) == (URL, KEY)
    assert local_server.resolve(URL + "/", None) == (URL + "/", KEY)  # the same server


def test_explicit_values_win_and_other_servers_never_get_the_key(data_dir) -> None:
    _write(data_dir)
    assert local_server.resolve("https://hosted.example", None) == ("https://hosted.example", None)
    assert local_server.resolve(None, "tml-mine") == (URL, "tml-mine")
    assert local_server.resolve("http://127.0.0.1:9", "k") == ("http://127.0.0.1:9", "k")
    _write(data_dir, url="http://10.0.0.5:8000")  # not loopback: ignored
    assert local_server.resolve(None, None) == (None, None)


@pytest.mark.parametrize("text", ["", "{", "[]", '{"url": "http://127.0.0.1:1"}'])
def test_a_missing_or_broken_file_is_ignored(data_dir, text) -> None:
    assert local_server.resolve(None, None) == (None, None)
    (data_dir / local_server.FILE_NAME).write_text(text)
    assert local_server.resolve(None, None) == (None, None)


def test_client_error_names_the_file_when_nothing_is_found(data_dir) -> None:
    with pytest.raises(TwinkleError, match="no local quick-start server .*quickstart.json"):
        TwinkleClient(session_heartbeat_interval=None)
