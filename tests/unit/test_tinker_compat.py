"""init_tinker_client's patch of the real tinker SDK (no server): environment, twinkle:// paths,
idempotence. The tokenizer download is exercised end to end in tests/e2e."""

from __future__ import annotations

import pytest
from tinker.types.checkpoint import ParsedCheckpointTinkerPath

from twinkle_client import init_tinker_client, tinker_compat


def test_env_paths_and_idempotence(monkeypatch):
    monkeypatch.setenv("TWINKLE_SERVER_URL", "http://127.0.0.1:9/")
    monkeypatch.setenv("TWINKLE_SERVER_TOKEN", "tml-abc")
    for name in ("TINKER_BASE_URL", "TINKER_API_KEY"):
        # set first so monkeypatch records it: what init_tinker_client exports is undone after the
        # test (a key left in os.environ would reach every later subprocess, e.g. an SDK's headers)
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    init_tinker_client()
    import os

    assert os.environ["TINKER_BASE_URL"] == "http://127.0.0.1:9"
    assert os.environ["TINKER_API_KEY"] == "tml-abc"
    parsed = ParsedCheckpointTinkerPath.from_tinker_path("twinkle://run-1/weights/step-3")
    assert parsed.training_run_id == "run-1" and parsed.checkpoint_type == "training"
    assert parsed.tinker_path == "tinker://run-1/weights/step-3"
    patched = ParsedCheckpointTinkerPath.from_tinker_path
    init_tinker_client(base_url="http://other:1", api_key="tml-xyz")  # second call: env only
    assert ParsedCheckpointTinkerPath.from_tinker_path == patched
    assert os.environ["TINKER_BASE_URL"] == "http://other:1"
    with pytest.raises(ValueError):
        ParsedCheckpointTinkerPath.from_tinker_path("s3://bucket/x")
    assert tinker_compat.as_tinker_path("twinkle://a/b/c") == "tinker://a/b/c"
    assert tinker_compat.as_tinker_path(None) is None
