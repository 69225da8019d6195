"""What a server's idle CPU costs a training loop beside it: the bare loop, quiet vs with load.

Usage (from the repository root):

    .venv/bin/python benchmarks/background_load.py                   # medium (25 M), 6 rounds
    .venv/bin/python benchmarks/background_load.py --models tiny,medium --rounds 8

Two parts, one run:

1. **The server's own CPU at rest**: a ``twinkle serve`` of the model (the same config as
   ``service_path.py``) started, left idle, and every process of its session read from
   ``/proc/<pid>/stat`` over ``--idle-seconds``: milliseconds of CPU per second per process.
2. **What that much CPU costs**: the bare torch + peft loop of ``service_path.py`` (all cores'
   threads) in rounds: a quiet block, then a block per synthetic load beside it (a process that
   spins ``busy`` ms every ``period`` ms: short bursts like the server's loops and heartbeats).
   Reports each load's step time relative to the quiet blocks of the same rounds.

Why: on 2 cores the service path reached 0.82-0.89 of the bare loop on the 25 M model
(``service_path.py``) while the Trainer's compute threads used the same CPU per step as the bare
loop. torch's intra-op threads meet at a barrier after every parallel op, so a burst that takes
one core stalls both threads: background work costs more wall time than its CPU share. This
measures that, instead of inferring it. Numbers: benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import service_path as sp  # benchmarks/ is on sys.path when run as a script

TICK = os.sysconf("SC_CLK_TCK")
#: (busy ms, period ms) of each synthetic load: ~0.05, ~0.09 and ~0.09 cores in longer bursts
LOADS = [(0.5, 10.0), (1.0, 10.0), (10.0, 100.0)]
SPIN = """
import sys, time
busy, period = float(sys.argv[1]) / 1e3, float(sys.argv[2]) / 1e3
while True:
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < busy:
        pass
    time.sleep(period)
"""


def _cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK  # utime + stime


def _name(pid: int) -> str:
    with open(f"/proc/{pid}/cmdline") as f:
        argv = f.read().split("\0")
    if argv[0].startswith("ray::"):
        return argv[0]
    return " ".join(Path(a).name if "/" in a else a for a in argv[:3])[:48]


def session_cpu(sid: int) -> dict[int, tuple[str, float]]:
    """CPU seconds so far of every process in session ``sid``: {pid: (name, seconds)}."""
    out: dict[int, tuple[str, float]] = {}
    for p in os.listdir("/proc"):
        if p.isdigit():
            with contextlib.suppress(OSError):
                if os.getsid(int(p)) == sid:
                    out[int(p)] = (_name(int(p)), _cpu_s(int(p)))
    return out


def idle_cpu(path: Path, served: str, work: Path, seconds: float) -> list[tuple[str, float]]:
    """(process, ms of CPU per second) of an idle `twinkle serve`, busiest first."""
    proc, _, _, _ = sp.start_server(path, served, work, None)
    try:
        time.sleep(5)  # start-up's last reconciliations
        before = session_cpu(proc.pid)
        time.sleep(seconds)
        after = session_cpu(proc.pid)
    finally:
        sp.stop_server(proc)
    rows = [
        (name, (cpu - before[p][1]) / seconds * 1e3)
        for p, (name, cpu) in after.items()
        if p in before
    ]
    return sorted(rows, key=lambda r: -r[1])


def load_cost(bare: sp.Bare, data: list, rounds: int) -> dict[str, list[float]]:
    """Mean bare step time per block: {'quiet': [...], 'busy/period': [...]} over ``rounds``."""
    times: dict[str, list[float]] = {"quiet": []}
    for r in range(rounds):
        print(f"[background_load] round {r + 1}/{rounds}", file=sys.stderr, flush=True)
        times["quiet"].append(statistics.mean(bare.steps(data, 0)))
        for busy, period in LOADS:
            spin = subprocess.Popen([sys.executable, "-c", SPIN, str(busy), str(period)])
            try:
                time.sleep(0.2)
                t = statistics.mean(bare.steps(data, 0))
            finally:
                spin.kill()
                spin.wait()
            times.setdefault(f"{busy:g}/{period:g}", []).append(t)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="medium")
    ap.add_argument(
        "--rounds", type=int, default=6, help="rounds of the load part (0: the idle CPU only)"
    )
    ap.add_argument("--steps", type=int, default=3, help="bare steps per block")
    ap.add_argument("--idle-seconds", type=float, default=15.0)
    a = ap.parse_args()
    for m in a.models.split(","):
        work = Path(tempfile.mkdtemp(prefix="twinkle-bgload-"))
        path, served = sp.model_dir(m, work)
        print(f"[background_load] {m}: the idle server ...", file=sys.stderr, flush=True)
        rows = idle_cpu(path, served, work, a.idle_seconds)
        total = sum(ms for _, ms in rows)
        print(f"\n{m}: an idle `twinkle serve`, CPU per process ({a.idle_seconds:g} s)")
        print(f"{'process':50} {'ms/s':>6}")
        for name, ms in rows:
            if ms >= 0.5:
                print(f"{name:50} {ms:6.1f}")
        print(f"{'total':50} {total:6.1f}  (= {total / 1e3:.3f} cores)")

        if a.rounds <= 0:  # the idle server's CPU only
            continue
        bare = sp.Bare(path)
        b, t = sp.SHAPE[m]
        data = sp.batches(bare.model.config.vocab_size, b, t, a.steps + 2)
        bare.steps(data[:2], 2)  # warm up
        times = load_cost(bare, data[2:], a.rounds)
        quiet = statistics.mean(times["quiet"])
        print(
            f"\n{m}: the bare loop ({sp.cores()} threads, {b}x{t}) beside a synthetic load, "
            f"{a.rounds} rounds x {a.steps} steps"
        )
        print(f"{'load busy/period ms':>20} {'cores':>6} {'step s':>7} {'quiet / loaded':>15}")
        for k, v in times.items():
            busy, period = (0.0, 1.0) if k == "quiet" else map(float, k.split("/"))
            step = statistics.mean(v)
            print(f"{k:>20} {busy / (busy + period):6.3f} {step:7.3f} {quiet / step:15.3f}")


if __name__ == "__main__":
    main()
