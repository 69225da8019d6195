"""gateway/cli/controller_loop.py inside a real Serve controller (a real local Ray, in its own
process: tests/e2e/quiet_controller_probe.py): while Serve is quiet the controller skips
control-loop passes, and a deploy, a delete, a dead replica and a shutdown are still handled at
Ray's pace.

The probe runs with a 20 s quiet interval (the default is 1 s) so that a wrapper that kept
skipping while Serve is busy could not pass on any host: a deploy, a delete and a shutdown each
take several passes, so each would take 20 s or more (40 s and up in practice) instead of the
2-7 s they take with passes every 0.1 s (7 s on a CI host also running pyright; even
with a 5 s interval, a 6 s bound is too tight there)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.launch import count_ray_cluster

pytestmark = [pytest.mark.e2e, pytest.mark.own_cluster]

PROBE = Path(__file__).with_name("quiet_controller_probe.py")


def test_quiet_controller_skips_passes_and_keeps_deploys_and_shutdown_fast() -> None:
    count_ray_cluster()  # the probe's local Ray
    proc = subprocess.run(
        [sys.executable, str(PROBE), "20"],
        capture_output=True,
        text=True,
        timeout=420,
        cwd=Path(__file__).parents[2],
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    # installed through Serve's controller callback, and it skipped passes while quiet: 8 s of
    # 0.1 s ticks, quiet from 5 s after the deploy, so ~25 skips (none before that)
    assert out["skipped_after_deploy"] == 0, out
    assert out["skipped_idle"] >= 10, out
    # what must keep Ray's 0.1 s pace (2-7 s each; a 20 s wait per pass: 40 s and up)
    assert out["redeploy_s"] < 15, out
    assert out["delete_s"] < 15, out
    assert out["shutdown_s"] < 15, out
    # a replica killed while quiet is found by full passes (about two: <= 40 s here) and
    # replaced (13.7 s with a 5 s interval, 2.4 s with Ray's loop)
    assert out["replace_s"] < 90, out
