"""The product's two-command quick start, as written, on both backends, in two "terminals" with
nothing set: ``python cookbook/client/server/{megatron,transformer}/server.py`` with the system
python (its shipped config, only the port moved to a free one), then a cookbook client script from
the same directory, which finds the local server by itself. The Megatron quick start is the pool's
``megatron`` profile (tests/e2e/quickstart.py), which the Megatron e2e tests use too."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import yaml

from gateway.config import ServerConfig
from tests.e2e.conftest import _free_port
from tests.e2e.quickstart import (
    PLAIN_PYTHON,
    REPO,
    SERVERS,
    Quickstart,
    launch_quickstart,
    plain_env,
)
from tests.launch import launch
from tests.tiny_models import seed_models

pytestmark = pytest.mark.e2e
MG_NAME = "twinkle/tiny-chat"
HERE = SERVERS / "megatron"


def test_shipped_configs_are_valid() -> None:
    tiny = ServerConfig.from_yaml(HERE / "server_config.yaml")
    assert (tiny.port, tiny.models[0].backend) == (8000, "megatron")
    assert tiny.models[0].megatron_config().tensor_parallel == 2
    big = ServerConfig.from_yaml(HERE / "server_config_4b.yaml")
    mc = big.models[0].megatron_config()
    assert big.models[0].backend == "megatron" and big.models[0].sampler_type == "vllm"
    assert (mc.params_dtype, mc.worker_num_gpus) == ("bfloat16", 1)
    tf = ServerConfig.from_yaml(SERVERS / "transformer" / "server_config.yaml")
    assert (tf.port, tf.models[0].backend, tf.models[0].name) == (8000, "transformers", MG_NAME)
    assert tf.models[1].name == "twinkle/tiny-vl"  # tinker/self_host/multi_modal.py's model


def _script(path: str, *args: str, cwd: Path) -> tuple[dict, str]:
    """``python cookbook/client/<path> args`` as a user types it (system python, nothing set):
    its final JSON line and its stderr (the per-step lines)."""
    out = subprocess.run(
        [PLAIN_PYTHON, str(REPO / "cookbook" / "client" / path), *args],
        env=plain_env(),
        capture_output=True,
        text=True,
        timeout=300,
        cwd=cwd,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1]), out.stderr


@pytest.fixture
def quickstart(backend: str, tmp_path: Path, pool, start_mg):
    """The started quick start of ``backend``: the Megatron one is the pool's ``megatron`` profile
    (started by that launcher; the Megatron e2e tests use it too), the Transformers one is started
    here and stopped after the test."""
    if backend == "megatron":
        pytest.importorskip("megatron.core")
        yield pool.get("megatron", start_mg).quickstart
        return
    qs = launch_quickstart(backend, tmp_path)
    try:
        yield qs
    finally:
        qs.started.stop(timeout=60)


@pytest.mark.parametrize(
    "backend", ["megatron", pytest.param("transformer", marks=pytest.mark.own_cluster)]
)
def test_two_terminals_with_nothing_set(quickstart: Quickstart, backend: str) -> None:
    """Terminal 1: ``python .../server/<backend>/server.py``; terminal 2, same directory:
    ``python .../{twinkle,tinker}/self_host/self_cognition.py``. All with the system python and no
    TWINKLE_* variable (the server's config is only moved to a free port; the Megatron one also
    serves its model's Transformers twin, which these scripts do not use)."""
    # started by this backend's launcher, with nothing set
    assert quickstart.started.proc.args[-1] == str(SERVERS / backend / "server.py")
    text, work, url, token = quickstart.text(), quickstart.work, quickstart.url, quickstart.token
    assert "Twinkle ready" in text, text[-2000:]
    assert httpx.get(f"{url}/api/v1/healthz", timeout=5).status_code == 200
    found = work / ".twinkle" / "quickstart.json"
    assert json.loads(found.read_text()) == {"url": url, "key": token}
    assert oct(found.stat().st_mode & 0o777) == "0o600"

    res, _ = _script("twinkle/self_host/self_cognition.py", "--max-steps", "4", cwd=work)
    assert len(res["losses"]) == 4 and all(map(float, res["losses"]))
    assert res["checkpoint"].startswith("twinkle://")
    saved = res["checkpoint"]

    # sample.py takes the newest checkpoint: self_cognition's
    res, _ = _script("twinkle/self_host/sample.py", "--prompts", "2", "--max-tokens", "8", cwd=work)
    assert res["adapter"] == saved and len(res["samples"]) == 4

    res, _ = _script(
        "twinkle/self_host/dpo.py", "--max-steps", "4", "--pairs-per-step", "8", cwd=work
    )
    assert res["losses"][-1] < res["losses"][0] and res["margins"][-1] > 0
    assert res["checkpoint"].startswith("twinkle://")

    res, err = _script("tinker/self_host/self_cognition.py", "--max-steps", "6", cwd=work)
    losses = res["losses"]  # batches of 4 out of 8 rows: steps 0, 2, 4 see the same rows
    assert len(losses) == 6 and losses[4] < losses[2] < losses[0]
    assert res["state"].startswith("tinker://") and len(res["samples"]) == 2
    assert res["sampler_path"].endswith("/sampler_weights/self-cognition")
    assert "step 6/6" in err  # a line per step

    # sample.py takes the newest sampler weights: self_cognition's
    sampled, _ = _script("tinker/self_host/sample.py", "--max-tokens", "8", cwd=work)
    assert sampled["model_path"] == res["sampler_path"]
    assert len(sampled["samples"]) == 2

    if backend == "transformer":  # the megatron config serves no VL model
        res, err = _script("tinker/self_host/multi_modal.py", "--max-steps", "3", cwd=work)
        assert len(res["losses"]) == 3 and res["losses"][-1] < res["losses"][0]
        assert len(res["read"]) == 8 and "step 3/3" in err
        res, err = _script("twinkle/self_host/multi_modal.py", "--max-steps", "3", cwd=work)
        assert len(res["losses"]) == 3 and res["losses"][-1] < res["losses"][0]
        assert len(res["read"]) == 8 and "step 3/3" in err

    res, _ = _script(
        "tinker/self_host/dpo.py", "--max-steps", "4", "--pairs-per-step", "8", cwd=work
    )
    assert res["margins"][0] == pytest.approx(0.0, abs=1e-6)  # policy == reference
    assert res["losses"][-1] < res["losses"][0] and res["margins"][-1] > 0
    assert res["state"].startswith("tinker://")


def test_tinker_sft_and_sample_script(server) -> None:
    """cookbook/client/tinker/self_host/sft_and_sample.py (what scripts/demo.sh runs) against the
    suite's server: it trains, the loss falls, it saves and prints samples."""
    env = plain_env(
        TWINKLE_SERVER_URL=server.url,
        TWINKLE_SERVER_TOKEN=server.create_key("cookbook-sft"),
        TINKER_TELEMETRY="0",
        HF_HUB_OFFLINE="1",
    )
    script = REPO / "cookbook/client/tinker/self_host/sft_and_sample.py"
    tok_dir = server.data_dir / "models" / "tiny-chat"
    args = ["--tokenizer-dir", str(tok_dir), "--steps", "20"]
    out = subprocess.run(
        [sys.executable, str(script), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    losses = [float(x) for x in re.findall(r"loss/token (\d+\.\d+)", out.stdout)]
    assert len(losses) >= 2 and losses[-1] < losses[0], out.stdout[-2000:]
    assert "saved tinker://" in out.stdout and "sample 0:" in out.stdout


@pytest.mark.own_cluster
def test_run_sh_serves_on_a_ray_cluster_it_starts_and_stops(tmp_path: Path) -> None:
    """``bash .../transformer/run.sh --cpu-workers 1``: a Ray head plus one worker node (token
    auth), the server joins that cluster (RAY_ADDRESS), a client trains through it; SIGTERM stops
    the server and both Ray nodes, and leaves no process of that cluster behind."""
    config = yaml.safe_load((SERVERS / "transformer" / "server_config.yaml").read_text())
    config["port"] = _free_port()
    cfg_path = tmp_path / "server_config.yaml"
    cfg_path.write_text(yaml.safe_dump(config))
    work = tmp_path / "work"
    seed_models(work / ".twinkle")
    log_path = tmp_path / "run.log"
    ray_port = str(_free_port())
    started = launch(
        ["bash", str(SERVERS / "transformer" / "run.sh"), "--cpu-workers", "1"]
        + ["--ray-port", ray_port],
        ready="Twinkle ready",
        log=log_path,
        env=plain_env(TWINKLE_SERVER_CONFIG=str(cfg_path)),
        cwd=work,
        kind="launcher",
    )
    proc = started.proc
    temp_dir = None
    try:
        text = log_path.read_text()
        joined = f"Joined the Ray cluster at 127.0.0.1:{ray_port}: 2 node(s)"
        assert joined in text, text[-3000:]
        m = re.search(r"temp dir: (\S+),", text)
        assert m, text[-3000:]
        temp_dir = m.group(1)
        token = work / ".twinkle" / "ray_auth_token"
        assert oct(token.stat().st_mode & 0o777) == "0o600"
        res, _ = _script("twinkle/self_host/self_cognition.py", "--max-steps", "2", cwd=work)
        assert len(res["losses"]) == 2 and res["checkpoint"].startswith("twinkle://")
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            assert proc.wait(timeout=90) in (0, 143)
        except subprocess.TimeoutExpired:
            started.kill()
            raise
        finally:
            started.stop()
    assert "[run.sh] Ray nodes stopped" in log_path.read_text()
    assert temp_dir is not None
    # No node recorded this (now dead) cluster where a bare ray.init() elsewhere would join it.
    recorded = Path("/tmp/ray/ray_current_cluster")
    assert not recorded.exists() or ray_port not in recorded.read_text()
    left = subprocess.run(["pgrep", "-f", temp_dir], capture_output=True, text=True).stdout
    assert left == "", f"Ray processes of {temp_dir} left behind: {left}"
