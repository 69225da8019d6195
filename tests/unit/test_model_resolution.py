"""Models by name (engine/base_models/registry.py, hub.py): a hub id resolves offline from a
locally populated Hugging Face cache (the cache layout huggingface_hub writes: blobs, snapshots,
refs), for the engine (`resolve_model_dir`) and for the torch-free gateway
(`ModelConfig.files_dir`); a missing model, a ModelScope id without the package, an unknown
built-in name and a model not pulled yet each fail with a message naming the model and how to
get it; `twinkle serve` reports it in one line, exit 2, before starting anything.

huggingface_hub reads HF_HUB_CACHE / HF_HUB_OFFLINE when imported, so every case runs in a fresh
interpreter with the environment set."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
REVISION = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture(scope="module")
def hf_cache(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Hugging Face cache holding the tiny model as ``testorg/tiny-chat`` at REVISION."""
    cache = tmp_path_factory.mktemp("hf-cache")
    repo = cache / "models--testorg--tiny-chat"
    snap = repo / "snapshots" / REVISION
    snap.mkdir(parents=True)
    (repo / "blobs").mkdir()
    for f in tiny_model_dir.iterdir():
        if f.is_file():
            blob = repo / "blobs" / f"blob-{f.name}"
            shutil.copy(f, blob)
            (snap / f.name).symlink_to(os.path.relpath(blob, snap))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(REVISION)
    return cache


def _run(code: str, cache: Path, data_dir: Path) -> dict:
    env = {
        **os.environ,
        "HF_HUB_CACHE": str(cache),
        "HF_HUB_OFFLINE": "1",
        "TWINKLE_DATA_DIR": str(data_dir),
    }
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=REPO
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


RESOLVE = """
import json
from engine.base_models.registry import resolve_model_dir
from engine.config import ModelConfig
from engine.errors import ConfigError
out = {}
for name in NAMES:
    try:
        out[name] = {"dir": str(resolve_model_dir(name, DATA)),
                     "files_dir": str(ModelConfig(name=name).files_dir(DATA))}
    except ConfigError as e:
        out[name] = {"error": str(e)}
print(json.dumps(out))
"""


def _resolve(names: list[str], cache: Path, data_dir: Path) -> dict:
    code = f"NAMES = {names!r}\nDATA = {str(data_dir)!r}\n" + RESOLVE
    return _run(code, cache, data_dir)


def test_a_hub_id_resolves_from_the_local_cache_offline(hf_cache, tmp_path):
    got = _resolve(["testorg/tiny-chat"], hf_cache, tmp_path)["testorg/tiny-chat"]
    snap = hf_cache / "models--testorg--tiny-chat" / "snapshots" / REVISION
    assert got == {"dir": str(snap), "files_dir": str(snap)}
    # and it is a model transformers loads from there
    from transformers import AutoConfig

    assert AutoConfig.from_pretrained(got["dir"]).model_type == "qwen2"


def test_missing_models_fail_naming_the_model_and_how_to_get_it(hf_cache, tmp_path):
    got = _resolve(
        ["testorg/absent", "ms://testorg/tiny-chat", "twinkle/nope", "smollm2-135m-instruct"],
        hf_cache,
        tmp_path,
    )
    absent = got["testorg/absent"]["error"]
    assert "model 'testorg/absent' is not in the local Hugging Face cache (offline)" in absent
    assert "hf download testorg/absent" in absent and "path:" in absent
    ms = got["ms://testorg/tiny-chat"]["error"]
    assert "ModelScope ids need the 'modelscope' package" in ms
    assert "unknown model 'twinkle/nope'" in got["twinkle/nope"]["error"]
    assert "twinkle/tiny-chat" in got["twinkle/nope"]["error"]
    smol = got["smollm2-135m-instruct"]["error"]
    assert "not pulled yet: run `twinkle models pull smollm2-135m-instruct`" in smol


def test_names_that_cannot_resolve_are_config_errors_at_parse_time():
    from engine.config import ModelConfig

    for name in ("my-model", "a/b/c", "ms://"):
        with pytest.raises(ValueError, match="needs a 'path', or a name that resolves"):
            ModelConfig(name=name)
    for name in ("org/name", "ms://org/name", "smollm2-135m-instruct", "twinkle/tiny-chat"):
        ModelConfig(name=name)


def test_serve_reports_a_missing_model_in_one_line(hf_cache, tmp_path):
    config = tmp_path / "server.yaml"
    config.write_text("models:\n  - name: testorg/absent\n")
    env = {**os.environ, "HF_HUB_CACHE": str(hf_cache), "HF_HUB_OFFLINE": "1"}
    env["TWINKLE_DATA_DIR"] = str(tmp_path / "data")
    out = subprocess.run(
        [str(Path(sys.executable).parent / "twinkle"), "serve", "--config", str(config)],
        env=env,
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )
    assert out.returncode == 2, out.stderr[-2000:]
    assert "twinkle serve: model 'testorg/absent' is not in the local Hugging Face cache" in (
        out.stderr
    )
    assert "Traceback" not in out.stderr
