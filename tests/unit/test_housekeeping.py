"""gateway/cli/housekeeping.py: which processes are Ray's housekeeping, and renicing a real
process tree (processes named as Ray names them, via ``exec -a``)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gateway.cli.housekeeping import (
    descendants,
    housekeeping_name,
    lower_housekeeping,
    set_nice,
)

pytestmark = pytest.mark.skipif(not Path("/proc/self").exists(), reason="needs Linux /proc")


@pytest.mark.parametrize(
    ("argv", "name"),
    [
        (["ray::ServeController", ""], "ray::ServeController"),
        (["ray::DashboardAgent"], "ray::DashboardAgent"),
        (["ray::ServeController.listen_for_change"], "ray::ServeController"),  # mid-method
        (
            ["/v/lib/python3.11/site-packages/ray/core/src/ray/gcs/gcs_server", "--log_dir=/x"],
            "gcs_server",
        ),
        (
            ["/v/bin/python", "-u", "/v/ray/_private/log_monitor.py", "--session-dir=/x"],
            "log_monitor.py",
        ),
        (["/v/bin/python", "/v/ray/dashboard/dashboard.py", "--host=127.0.0.1"], "dashboard.py"),
        # never: replicas compute, and the raylet's future workers would inherit its value
        (["ray::ServeReplica:twinkle:trainer-bench-tiny"], None),
        (["ray::ServeReplica:twinkle:gateway"], None),
        (["/v/ray/core/src/ray/raylet/raylet", "--raylet_socket_name=/x"], None),
        (["/v/bin/python", "train.py", "--config", "monitor.py"], None),  # 4th arg: not a program
        ([""], None),
        ([], None),
    ],
)
def test_housekeeping_name(argv, name) -> None:
    assert housekeeping_name(argv) == name


def _nice(pid: int) -> set[int]:
    return {
        os.getpriority(os.PRIO_PROCESS, int(t.name)) for t in Path(f"/proc/{pid}/task").iterdir()
    }


def test_lower_housekeeping_renices_every_thread_of_the_right_processes() -> None:
    """A tree like a local Ray's: a "raylet" whose children are a controller (with a second
    thread) and a replica, and a "gcs_server" grandchild-of-root. Only the controller and the GCS
    change, on every thread; the root (this test) is left alone with include_root=False."""
    two_threads = "import threading,time; threading.Thread(target=time.sleep, args=(60,)).start()"
    threaded = f"{sys.executable} -c '{two_threads}; time.sleep(60)'"
    script = (
        f"(exec -a ray::ServeController {threaded}) & "
        "(exec -a ray::ServeReplica:twinkle:trainer sleep 60) & "
        "(exec -a /x/gcs_server sleep 60) & "
        "(exec -a /x/raylet sleep 60) & wait"
    )
    tree = subprocess.Popen(["bash", "-c", script])
    try:
        deadline = time.monotonic() + 20
        while True:
            names = {}
            for pid in descendants(os.getpid()):
                try:
                    argv0 = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode()
                except OSError:
                    continue
                names[argv0] = pid
            ctl = names.get("ray::ServeController")
            if (
                ctl
                and len(list(Path(f"/proc/{ctl}/task").iterdir())) >= 2
                and {"/x/gcs_server", "/x/raylet", "ray::ServeReplica:twinkle:trainer"}
                <= set(names)
            ):
                break
            assert time.monotonic() < deadline, names
            time.sleep(0.1)
        mine = os.getpriority(os.PRIO_PROCESS, 0)
        done = lower_housekeeping(os.getpid(), 10, include_root=False)
        assert sorted(done) == ["gcs_server", "ray::ServeController"]
        assert _nice(ctl) == {10}  # both threads
        assert _nice(names["/x/gcs_server"]) == {10}
        assert _nice(names["ray::ServeReplica:twinkle:trainer"]) == {mine}
        assert _nice(names["/x/raylet"]) == {mine}
        assert os.getpriority(os.PRIO_PROCESS, 0) == mine
        assert lower_housekeeping(os.getpid(), 10, include_root=False) == []  # already there
        assert lower_housekeeping(os.getpid(), 0, include_root=False) == []  # 0: off
    finally:
        for pid in descendants(tree.pid):
            with contextlib.suppress(OSError):
                os.kill(pid, 9)
        tree.kill()
        tree.wait()


def test_a_process_gone_meanwhile_is_skipped() -> None:
    """Processes come and go while the tree is walked: one that exited is no error."""
    gone = subprocess.Popen(["true"])
    gone.wait()
    assert set_nice(gone.pid, 10) == 0
    assert descendants(gone.pid) == []
