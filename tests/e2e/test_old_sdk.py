"""The oldest tinker SDK line whose wire format we serve (0.16.x: JSON forward/backward bodies,
JSON results, the /forward route) runs an SFT loop and samples through `twinkle serve`, in a venv
of its own, and gets the same numbers as SDK 0.38.0 (protobuf) on the same run.

The venv lives in <repo>/.cache/tinker-sdk-<version>/ (kept between runs): tinker is installed with
pip from PyPI (or pip's cache) without dependencies; its dependencies come from the project venv
through a .pth file, so only the SDK itself differs. The test skips, saying so, only when PyPI
cannot be reached and the wheel is not cached.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import numpy as np
import pytest
import tinker
from tinker import types

pytestmark = pytest.mark.e2e
OLD_VERSION = "0.16.1"
REPO = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).parent / "old_sdk" / "sft_and_sample.py"


def _old_sdk_python() -> str:
    venv = REPO / ".cache" / f"tinker-sdk-{OLD_VERSION}"
    py = venv / "bin" / "python"
    marker = venv / ".ready"
    if marker.exists():
        return str(py)
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    site = subprocess.run(
        [str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    # Dependencies (httpx, pydantic, numpy, ...) from the project venv, after the venv's own
    # site-packages, so the old tinker shadows the new one.
    Path(site, "zz_project_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    wheels = REPO / ".cache" / "wheels"
    dl = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "-q",
            "-d",
            str(wheels),
            f"tinker=={OLD_VERSION}",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    if dl.returncode != 0:
        pytest.skip(f"PyPI unreachable and tinker=={OLD_VERSION} not cached: {dl.stderr[-300:]}")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--no-index",
            "--find-links",
            str(wheels),
            "--target",
            site,
            f"tinker=={OLD_VERSION}",
        ],
        check=True,
        timeout=300,
    )
    marker.write_text(OLD_VERSION)
    return str(py)


def _new_sdk_run(url: str, key: str) -> dict:
    """The script's run through SDK 0.38.0 in this process."""
    rng = np.random.default_rng(4321)
    seqs = [rng.integers(10, 500, size=11).tolist() for _ in range(3)]
    data = [
        types.Datum(
            model_input=types.ModelInput.from_ints(s[:-1]),
            loss_fn_inputs={"target_tokens": s[1:], "weights": [1.0] * (len(s) - 1)},
        )
        for s in seqs
    ]
    sc = tinker.ServiceClient(base_url=url, api_key=key)
    tc = sc.create_lora_training_client(base_model="twinkle/tiny-chat", rank=4, seed=13).result()
    losses = []
    for _ in range(4):
        fb = tc.forward_backward(data, "cross_entropy")
        opt = tc.optim_step(types.AdamParams(learning_rate=1e-2))
        losses.append(fb.result().metrics["loss:sum"])
        opt.result()
    fwd = tc.forward(data, "cross_entropy").result()
    sampler = tc.save_weights_and_get_sampling_client().result()
    res = sampler.sample(
        types.ModelInput.from_ints(seqs[0][:4]),
        2,
        types.SamplingParams(max_tokens=5, temperature=0.0),
    ).result()
    sc.close("success")
    return {
        "losses": losses,
        "forward": fwd.metrics["loss:sum"],
        "logprobs0": fwd.loss_fn_outputs[0]["logprobs"].tolist(),
        "tokens": [list(s.tokens) for s in res.sequences],
        "sample_logprobs": [list(s.logprobs) for s in res.sequences],
    }


def test_oldest_supported_sdk_trains_and_samples_like_the_current_one(server, api_key):
    py = _old_sdk_python()
    env = {**server.env, "TINKER_TELEMETRY": "0", "PYTHONPATH": ""}
    proc = subprocess.run(
        [py, str(SCRIPT), server.url, api_key],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        cwd=str(SCRIPT.parent),
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    old = json.loads(proc.stdout.strip().splitlines()[-1])
    assert old["version"] == OLD_VERSION
    new = _new_sdk_run(server.url, api_key)
    np.testing.assert_allclose(old["losses"], new["losses"], atol=1e-5)
    assert old["losses"][-1] < old["losses"][0]
    assert old["forward"] == pytest.approx(new["forward"], abs=1e-5)
    np.testing.assert_allclose(old["logprobs0"], new["logprobs0"], atol=1e-5)
    assert old["tokens"] == new["tokens"]
    np.testing.assert_allclose(old["sample_logprobs"], new["sample_logprobs"], atol=1e-5)
    assert os.path.exists(py)
