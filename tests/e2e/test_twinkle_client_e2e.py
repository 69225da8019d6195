"""The native client against a real `twinkle serve` (Ray Serve, the tiny model).

* the same SFT script run in process (engine class) and remotely (twinkle_client), only the
  model class differs, gives equal losses; save + resume_from_checkpoint continue the trajectory;
* a DPO step and a GRPO step built from sampled completions;
* existing Tinker SDK code after init_tinker_client(), with only TWINKLE_SERVER_URL /
  TWINKLE_SERVER_TOKEN set (fresh process, no hub);
* twinkle_client installed alone in a fresh venv without torch runs the cookbook SFT loop.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import twinkle_client
from engine.local.model import MultiLoraTransformersModel as LocalModel
from tests.twinkle_scripts import BASE, dpo_step, grpo_step, hf_data, roll, sft_script
from twinkle_client.model import MultiLoraTransformersModel as RemoteModel
from twinkle_client.sampler import vLLMSampler

pytestmark = pytest.mark.e2e
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tw(server, api_key):
    client = twinkle_client.init_twinkle_client(server.url, api_key)
    yield client
    client.close()


def test_same_script_in_process_and_remote(server, tw, tmp_path):
    model_dir = server.data_dir / "models" / "tiny-chat"  # built by the server; same recipe
    data = roll(hf_data(model_dir))  # upstream's rows: rolled labels, in process too
    local = sft_script(LocalModel, str(model_dir), data, data_dir=tmp_path)
    remote = sft_script(RemoteModel, BASE, data)  # the client from init_twinkle_client
    np.testing.assert_allclose(remote["losses"], local["losses"], rtol=0, atol=1e-5)
    np.testing.assert_allclose(remote["resumed"], local["resumed"], rtol=0, atol=1e-5)
    np.testing.assert_allclose(remote["norms"], local["norms"], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(remote["resumed"], remote["losses"][4:], rtol=0, atol=1e-5)
    assert remote["losses"][-1] < remote["losses"][0]
    assert remote["resume_info"]["cur_step"] == 2
    run_id = remote["ckpt"].removeprefix("twinkle://").split("/")[0]
    assert [c.twinkle_path for c in tw.list_checkpoints(run_id)] == [remote["ckpt"]]


def test_dpo_and_grpo_steps(server, tw):
    dpo = dpo_step(RemoteModel, BASE, roll(hf_data(server.data_dir / "models" / "tiny-chat")))
    assert np.isfinite(dpo["loss"]) and dpo["metrics"]["grad_norm"] > 0
    assert "dpo_accuracy:mean" in dpo["output"]["metrics"]
    grpo = grpo_step(RemoteModel, vLLMSampler, BASE)
    assert grpo["num_sequences"] == 4 and np.isfinite(grpo["loss"])
    assert grpo["metrics"]["grad_norm"] > 0


def _run(cmd, env, timeout=300):
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=REPO)
    assert out.returncode == 0, (
        f"{cmd}\nstdout:\n{out.stdout[-3000:]}\nstderr:\n{out.stderr[-3000:]}"
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def _bare_env(server, key: str, home: Path) -> dict[str, str]:
    """Only what a user would set: the two TWINKLE_* variables (plus PATH/HOME, and HF offline
    switches that prove no model hub is asked)."""
    return {
        "PATH": os.environ["PATH"],
        "HOME": str(home),
        "TWINKLE_SERVER_URL": server.url,
        "TWINKLE_SERVER_TOKEN": key,
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
    }


def test_plain_tinker_code_after_init_tinker_client(server, tmp_path):
    env = _bare_env(server, server.create_key("carol"), tmp_path)
    script = REPO / "cookbook/client/tinker/self_host/init_tinker_client_sft.py"
    res = _run([sys.executable, str(script)], env)
    assert len(res["losses"]) == 6 and res["losses"][-1] < res["losses"][0]
    assert res["path"].startswith("twinkle://") and isinstance(res["sample"], str)
    assert res["tokenizer_dir"].startswith(str(tmp_path / ".cache" / "twinkle"))


def test_grpo_cookbook(server, tmp_path):
    env = _bare_env(server, server.create_key("erin"), tmp_path)
    script = REPO / "cookbook/client/twinkle/self_host/short_math_grpo.py"
    # seeded: unseeded, both groups of 2 sometimes score alike (zero advantages, so no gradient;
    # seen once in 6 CI runs), which is GRPO behaving, not a failure
    args = ["--steps", "2", "--generations", "2", "--seed", "0"]
    res = _run([sys.executable, str(script), *args], env)
    assert len(res["steps"]) == 2
    assert all(s["grad_norm"] > 0 and s["step"] >= 1 for s in res["steps"])


def test_client_alone_in_a_fresh_venv_without_torch(server, tmp_path):
    venv = tmp_path / "venv"
    subprocess.run(["python3.11", "-m", "venv", str(venv)], check=True, timeout=120)
    py = str(venv / "bin" / "python")
    src = tmp_path / "client-src"  # a copy: pip's build/ dir must not land in the repo
    shutil.copytree(REPO / "client", src, ignore=shutil.ignore_patterns("build", "*.egg-info"))
    pip = subprocess.run(
        [py, "-m", "pip", "install", "-q", str(src)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert pip.returncode == 0, pip.stderr[-3000:]
    probe = subprocess.run([py, "-c", "import torch"], capture_output=True, timeout=60)
    assert probe.returncode != 0  # torch is not there, and not needed
    env = _bare_env(server, server.create_key("dave"), tmp_path)
    script = REPO / "cookbook/client/twinkle/self_host/self_cognition.py"
    res = _run([py, str(script), "--max-steps", "6"], env)
    assert len(res["losses"]) == 6 and res["losses"][-1] < res["losses"][0]
    assert res["checkpoint"].startswith("twinkle://") and res["metrics"]["step"] == 3
    # and it resumes from its own checkpoint
    again = _run([py, str(script), "--max-steps", "8", "--resume", res["checkpoint"]], env)
    assert len(again["losses"]) == 2
