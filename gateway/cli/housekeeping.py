"""Ray's housekeeping processes at a lower CPU priority (a higher nice value).

A private local Ray (``twinkle serve`` without ``ray.address``) runs, beside the Trainer, Sampler
and gateway replicas, processes that only keep the cluster going: the GCS, the autoscaler
monitor, the dashboard and its agent, the log monitor, the runtime-env agent, Serve's controller
and the ``twinkle serve`` driver itself. At rest they use 0.05-0.1 cores (benchmarks/README.md,
``background_load.py``: controller 21-36 ms/s, GCS 12-20, ...), in short bursts. On a small
CPU host a burst that takes a core stalls both of the Trainer's torch threads (they meet at a
barrier after every parallel op), so it costs training about twice its CPU share. With these
processes at nice 10 the 25 M model's service path gained 1-5 points against a bare loop on 2
cores (0.82-0.84 -> 0.85-0.88, four paired runs of ``service_path.py``) and the tiny model's fixed
cost per step fell from 0.053 to 0.037 s.

Ray's own priorities, for reference: it starts every worker (replicas included) with its task
threads at nice 15 and its service threads at 0, and its system processes at 0, so that busy
workers cannot starve the cluster. Nice 10 keeps that order (housekeeping still ahead of the
workers' task threads, so heartbeats and health checks keep their CPU on a saturated host)
while putting it behind the replicas' service threads and any other program at nice 0.

``lower_housekeeping(root, nice)`` sets ``nice`` on every thread (Linux's nice value is per
thread) of those processes among ``root``'s descendants. The raylet is left alone: every worker
it starts later (a new Trainer or Sampler replica, a restarted one) would inherit its nice value,
and lowering it back needs privileges. Replicas (``ray::ServeReplica:*``) are never touched.
Linux only (it reads ``/proc``); elsewhere it does nothing. Raising one's own processes' nice
value needs no privilege.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

#: process names (Ray sets its workers' argv[0] to ``ray::<actor class>``) or program basenames
HOUSEKEEPING = (
    "ray::ServeController",
    "ray::DashboardAgent",
    "ray::RuntimeEnvAgent",
    "gcs_server",
    "monitor.py",
    "dashboard.py",
    "log_monitor.py",
)
PROC = Path("/proc")


def _argv(pid: int) -> list[str]:
    return (PROC / str(pid) / "cmdline").read_bytes().decode(errors="replace").split("\0")


def _ppid(pid: int) -> int:
    stat = (PROC / str(pid) / "stat").read_text()
    return int(stat.rsplit(")", 1)[1].split()[1])  # the name, in parentheses, may hold spaces


def housekeeping_name(argv: list[str]) -> str | None:
    """Which of Ray's housekeeping processes this command line is (an entry of
    ``HOUSEKEEPING``), or None."""
    if not argv or not argv[0]:
        return None
    if argv[0].startswith("ray::"):
        # while a worker runs a method, Ray retitles it ray::Class.method (the controller is
        # "ray::ServeController.listen_for_change" much of the time)
        name = argv[0].split()[0].split(".")[0]
        return name if name in HOUSEKEEPING else None
    # a program (gcs_server) or a script run by python (python -u .../log_monitor.py --...)
    return next((Path(a).name for a in argv[:3] if Path(a).name in HOUSEKEEPING), None)


def descendants(root: int) -> list[int]:
    """Every live process below ``root`` (children, their children, ...)."""
    children: dict[int, list[int]] = {}
    try:
        entries = list(PROC.iterdir())
    except OSError:  # a /proc this process may not list (a locked-down container): do nothing
        return []
    for entry in entries:
        if entry.name.isdigit():
            with contextlib.suppress(OSError, ValueError, IndexError):
                children.setdefault(_ppid(int(entry.name)), []).append(int(entry.name))
    out, todo = [], list(children.get(root, []))
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo += children.get(pid, [])
    return out


def set_nice(pid: int, nice: int) -> int:
    """Raise the nice value of every thread of ``pid`` to ``nice`` (never lower it): the number
    of threads changed."""
    changed = 0
    try:
        tasks = list((PROC / str(pid) / "task").iterdir())
    except OSError:  # it exited meanwhile
        return 0
    for task in tasks:
        with contextlib.suppress(OSError, ValueError):
            tid = int(task.name)
            if os.getpriority(os.PRIO_PROCESS, tid) < nice:
                os.setpriority(os.PRIO_PROCESS, tid, nice)
                changed += 1
    return changed


def lower_housekeeping(root: int, nice: int, include_root: bool = True) -> list[str]:
    """Set ``nice`` on Ray's housekeeping processes below ``root`` (and on ``root``, the driver,
    with ``include_root``): the names of the processes changed. No-op where there is no /proc
    (nothing lists) or ``nice`` is 0."""
    if nice <= 0:
        return []
    done = []
    for pid in descendants(root):
        with contextlib.suppress(OSError):
            name = housekeeping_name(_argv(pid))
            if name and set_nice(pid, nice):
                done.append(name)
    if include_root:
        with contextlib.suppress(OSError):
            if set_nice(root, nice):
                done.append("twinkle serve")
    return done
