"""The Tinker-SDK cookbook scripts lora.py and short_math_grpo.py (cookbook/client/tinker/self_host)
run as a user runs them, against the suite's real server: each as a subprocess with only
TWINKLE_SERVER_URL / TWINKLE_SERVER_TOKEN set, checked on its own outcome (its final JSON line),
and the server's record checked with the real SDK."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import tinker

pytestmark = pytest.mark.e2e
REPO = Path(__file__).resolve().parents[2]
SELF_HOST = REPO / "cookbook" / "client" / "tinker" / "self_host"
MODEL = "twinkle/tiny-chat"


def _run(server, key: str, script: str, *args: str) -> tuple[dict, str]:
    """``python cookbook/client/tinker/self_host/<script> args`` with a user's shell plus the
    server's URL and key: its final JSON line and its stderr (the per-step lines)."""
    env = {
        "PATH": os.environ["PATH"],
        "HOME": os.environ.get("HOME", "/root"),
        "TWINKLE_SERVER_URL": server.url,
        "TWINKLE_SERVER_TOKEN": key,
        "TINKER_TELEMETRY": "0",
        "HF_HUB_OFFLINE": "1",
    }
    out = subprocess.run(
        [sys.executable, str(SELF_HOST / script), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1]), out.stderr


def _run_id(path: str) -> str:
    return path.removeprefix("tinker://").split("/")[0]


def test_lora_trains_saves_publishes_and_resumes(server) -> None:
    key = server.create_key("cookbook-tinker-lora")
    first, err = _run(server, key, "lora.py", "--epochs", "2", "--max-steps", "3")
    losses = first["losses"]
    assert len(losses) == 6 and all(map(math.isfinite, losses))
    assert losses[5] < losses[2] < losses[0], losses  # falls across both epochs
    assert (first["start_step"], first["final_step"]) == (0, 6)
    assert first["optimizer_steps"] == [1, 2, 3, 4, 5, 6]
    run = _run_id(first["states"][0])
    assert first["states"] == [
        f"tinker://{run}/weights/pig-latin-lora-step-3",
        f"tinker://{run}/weights/pig-latin-lora-step-6",
    ]
    assert first["published"] == first["states"][-1]
    assert MODEL in first["supported_models"] and first["runs_listed"] == 0  # a new user
    assert "epoch 2/2  step 6" in err

    # The server's record, through the SDK: both states listed, only the published one public,
    # and readable by another user.
    rest = tinker.RestClient(base_url=server.url, api_key=key)
    listed = {c.tinker_path: c for c in rest.list_checkpoints(run).result().checkpoints}
    assert set(listed) == set(first["states"])
    assert [listed[p].public for p in first["states"]] == [False, True]
    assert all(c.checkpoint_type == "training" for c in listed.values())
    other = tinker.RestClient(base_url=server.url, api_key=server.create_key("cookbook-other"))
    assert other.get_weights_info_by_tinker_path(first["published"]).result().base_model == MODEL

    # --resume-latest finds the newest state in the listing and goes on from its step, with the
    # optimizer state restored (the server's optimizer step counter continues).
    resume = ["--resume-latest", "--epochs", "1", "--max-steps", "2", "--no-publish"]
    second, err = _run(server, key, "lora.py", *resume)
    assert second["resumed_from"] == first["states"][-1] and second["runs_listed"] == 1
    assert (second["start_step"], second["final_step"]) == (6, 8)
    assert second["optimizer_steps"] == [7, 8]
    assert second["losses"][0] < losses[-1] < losses[0]  # trained weights, not a fresh adapter
    assert second["losses"][1] < second["losses"][0]
    assert second["states"][0].endswith("/weights/pig-latin-lora-step-8")
    assert _run_id(second["states"][0]) != run and second["published"] is None
    assert "resuming from" in err and "step 8" in err


def _check_grpo_steps(res: dict, batch: int, generations: int) -> None:
    for s in res["steps"]:
        rewards = s["rewards"]
        assert len(rewards) == batch * generations and all(map(math.isfinite, rewards))
        assert s["mean_reward"] == pytest.approx(sum(rewards) / len(rewards))
        # every group with any spread in its rewards is trained, all of its completions
        assert s["trained_datums"] == generations * (batch - s["no_signal_groups"])
        assert len(s["advantages"]) == s["trained_datums"]
    assert res["state"].startswith("tinker://")
    assert res["state"].endswith("/weights/arithmetic-grpo-final")


def test_short_math_grpo_steps_train(server) -> None:
    key = server.create_key("cookbook-tinker-grpo")
    args = ["--batch-size", "2", "--generations", "4", "--max-tokens", "8", "--seed", "0"]
    res, err = _run(
        server, key, "short_math_grpo.py", "--max-steps", "2", "--reward", "shaped", *args
    )
    assert len(res["steps"]) == 2 and res["reward"] == "shaped"
    _check_grpo_steps(res, 2, 4)
    assert "step 2/2" in err
    trained = [s for s in res["steps"] if s["trained_datums"]]
    assert trained, res  # the shaped reward (partial credit, brevity) gives the groups a spread
    for s in trained:
        assert any(a != 0 for a in s["advantages"])
        assert sum(s["advantages"]) == pytest.approx(0.0, abs=1e-4)  # centred per group
        assert math.isfinite(s["loss"]) and s["grad_norm"] > 0  # optim_step ran on a gradient
        # the sampler ran the very policy being trained: importance ratio ~1
        assert abs(s["kl_sample_train"]) < 1e-3
    rest = tinker.RestClient(base_url=server.url, api_key=key)
    saved = rest.list_checkpoints(_run_id(res["state"])).result().checkpoints
    assert res["state"] in [c.tinker_path for c in saved if c.checkpoint_type == "training"]

    # The exact-answer reward, which the untrained tiny model almost never earns: the script
    # still runs, reports the groups without signal, and trains only the others.
    res, _ = _run(server, key, "short_math_grpo.py", "--max-steps", "1", "--reward", "exact", *args)
    _check_grpo_steps(res, 2, 4)
    step = res["steps"][0]
    assert all(r in (0.0, 1.0) for r in step["rewards"])
    if not any(step["rewards"]):  # nothing right (the usual case): no signal, no update
        assert step["no_signal_groups"] == 2 and step["trained_datums"] == 0
        assert step["loss"] is None and step["grad_norm"] is None
