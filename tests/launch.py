"""Starting long-running test subprocesses: `twinkle serve`, a cookbook launcher, a Ray node.

`launch` starts one (its own session, output to a log file) and waits until it is ready; `stop`
ends it (SIGTERM, then SIGKILL of its whole process group). Every start is counted here, and so
is every Ray cluster a test brings up (`count_ray_cluster`): tests/conftest.py prints the totals
at the end of the session, as ``[suite] twinkle serve started N times (Ray clusters: M)``, and
records them in the JUnit report for scripts/test_times.py.
"""

from __future__ import annotations

import collections
import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

#: what was started this session: "twinkle serve", "ray cluster", "launcher" -> count
STARTS: collections.Counter[str] = collections.Counter()
#: a start takes ~10 s; a 1 s poll wastes ~0.5 s of each, 0.25 s polls ~0.1 s
POLL_S = 0.25


def count_ray_cluster() -> None:
    """Count a Ray cluster a test started without `launch` (a probe in a child process, a
    two-node cluster)."""
    STARTS["ray cluster"] += 1


def summary() -> str:
    return (
        f"[suite] twinkle serve started {STARTS['twinkle serve']} times "
        f"(Ray clusters: {STARTS['ray cluster']}; cookbook launchers: {STARTS['launcher']})"
    )


@dataclass
class Launched:
    """A started subprocess and its log (``log_path``, written until `stop`)."""

    proc: subprocess.Popen
    log_path: Path
    _log: IO[str] = field(repr=False)

    def text(self) -> str:
        return self.log_path.read_text()

    def stop(self, timeout: float = 60) -> int | None:
        """SIGTERM, and SIGKILL of the process group after ``timeout`` s; the exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
        self._log.close()
        return self.proc.returncode

    def kill(self) -> None:
        """SIGKILL the whole process group (a Ray cluster it started included)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()


def launch(
    cmd: list[str],
    *,
    ready: str | Callable[[], bool],
    log: Path,
    env: dict[str, str],
    cwd: Path | str | None = None,
    timeout: float = 240,
    kind: str = "twinkle serve",
    new_ray_cluster: bool = True,
) -> Launched:
    """Start ``cmd`` in its own session with its output in ``log`` and wait until ``ready``: a
    string in the log, or a callable returning True. An early exit or ``timeout`` s without being
    ready raises with the log's tail (and kills what was started). ``kind`` is what it counts as
    ("twinkle serve" or "launcher"); ``new_ray_cluster``: it starts a Ray cluster of its own (not
    one given by RAY_ADDRESS)."""
    out = open(log, "w")  # noqa: SIM115 (the process writes it until `stop`)
    proc = subprocess.Popen(
        cmd, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=cwd, start_new_session=True
    )
    STARTS[kind] += 1
    if new_ray_cluster:
        count_ray_cluster()
    started = Launched(proc, log, out)
    check = (lambda: ready in log.read_text()) if isinstance(ready, str) else ready
    deadline = time.monotonic() + timeout
    while not check():
        if proc.poll() is not None:
            out.close()
            raise RuntimeError(f"{cmd[0]} exited early:\n{log.read_text()[-4000:]}")
        if time.monotonic() > deadline:
            started.kill()
            out.close()
            raise RuntimeError(f"{cmd[0]} not ready in {timeout:.0f} s:\n{log.read_text()[-4000:]}")
        time.sleep(POLL_S)
    return started
