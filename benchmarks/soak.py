"""Soak: many tenants on one `twinkle serve` at once, for a bounded time; is anything lost?

Usage (from the repository root; loopback only, bounded in time and in steps per tenant):

    .venv/bin/python benchmarks/soak.py                       # 32 tenants, 10 minutes
    .venv/bin/python benchmarks/soak.py --quick               # 8 tenants, 60 s
    .venv/bin/python benchmarks/soak.py --tenants 16 --seconds 300 --json out.json

Starts a `twinkle serve` (the tiny model, SQLite, its own data dir and port), makes one user and
key per tenant through the admin API, and runs the tenants (benchmarks/soak_tenants.py: Tinker SDK
SFT and RL, the native client, OpenAI streaming, raw retries with the same seq_id, clients that
vanish mid-run) in ``--workers`` processes, as threads. The vanishing clients each run in a
process of their own that is SIGKILLed after 3-15 s and replaced, until the time is up.

Reports:

* futures issued vs completed vs failed, per role (the client's books); and per training or
  sampling session the server's own record (its request_traces rows, one per finished request)
  against what the client submitted, by kind: fewer rows = lost, more = duplicated, a request id
  twice = duplicated;
* retries: resends answered with the first future vs with another one;
* latency p50 / p99 per route (submission to result, the client's clock);
* fairness: each tenant's share of its role's optimizer steps (min / max over the role's tenants,
  and Jain's index, 1.0 = equal);
* RSS of the gateway, the Trainer and the Sampler replicas and the `twinkle serve` driver, at the
  start (all tenants running) and at the end, and the largest seen;
* errors by category; whether the server still answers healthz afterwards;
* secrets: every API key used (the tenants' and the admin's) searched for, byte for byte, in the
  server's log, /metrics, every file of its data dir (the SQLite DB and its WAL, traces, checkpoint
  files) and its Ray session's log files; any hit is a leak and fails the run.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from service_path import start_server_config, stop_server  # noqa: E402
from soak_tenants import BASE  # noqa: E402

TWINKLE = str(Path(sys.executable).parent / "twinkle")
#: the role mix of 32 tenants; other sizes keep the proportions (at least one vanishing client)
MIX = {"sft": 10, "rl": 6, "native": 6, "openai": 4, "retry": 4, "vanish": 2}
#: processes named so on Ray: what the RSS columns cover
PROCS = {
    "gateway": "ServeReplica:twinkle:gateway",
    "trainer": "ServeReplica:twinkle:trainer",
    "sampler": "ServeReplica:twinkle:sampler",
}


def roles_for(n: int) -> list[str]:
    """``n`` roles in MIX's proportions (largest remainders), vanish at least once."""
    total = sum(MIX.values())
    quota = {r: n * k / total for r, k in MIX.items()}
    counts = {r: int(q) for r, q in quota.items()}
    counts["vanish"] = max(counts["vanish"], 1)
    for r in sorted(quota, key=lambda r: quota[r] - int(quota[r]), reverse=True):
        if sum(counts.values()) >= n:
            break
        counts[r] += 1
    while sum(counts.values()) > n:
        counts[max(counts, key=lambda r: counts[r])] -= 1
    return [r for r, k in counts.items() for _ in range(k)]


# ----------------------------------------------------------------------------------- server side


def descendants(root: int) -> list[int]:
    """``root`` and every process below it (Ray's raylet, GCS and workers of a private cluster
    are children of the `twinkle serve` driver: other servers on the machine are not counted)."""
    children: dict[int, list[int]] = defaultdict(list)
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children[ppid].append(int(d.name))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo += children.get(pid, [])
    return out


def rss_mb(root: int) -> dict[str, float]:
    """Resident MB of the server's processes (``root``'s tree), by PROCS summed over replicas;
    the driver is ``root`` itself."""
    out: dict[str, float] = defaultdict(float)
    for pid in descendants(root):
        d = Path(f"/proc/{pid}")
        try:
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            status = (d / "status").read_text()
        except OSError:
            continue
        name = next((k for k, v in PROCS.items() if v in cmd), None)
        if pid == root:
            name = "serve driver"
        if name is None:
            continue
        kb = next((int(line.split()[1]) for line in status.splitlines() if line[:6] == "VmRSS:"), 0)
        out[name] += kb / 1024
    return dict(out)


class RssSampler(threading.Thread):
    def __init__(self, root: int, period: float = 5.0) -> None:
        super().__init__(daemon=True)
        self.root, self.period, self.samples = root, period, []
        self._halt = threading.Event()

    def run(self) -> None:
        while not self._halt.wait(self.period):
            self.samples.append(rss_mb(self.root))

    def stop(self) -> list[dict[str, float]]:
        self._halt.set()
        self.join()
        self.samples.append(rss_mb(self.root))
        return self.samples


def ray_session_dir(root: int) -> Path | None:
    """The Ray session directory of the server's private cluster (from its raylet's command
    line), whose logs/ the secrets scan reads."""
    for pid in descendants(root):
        try:
            args = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        for arg in args:
            if arg.startswith("--session_dir=") or arg.startswith("--session-dir="):
                return Path(arg.split("=", 1)[1])
    return None


def secret_places(work: Path, metrics: bytes, session_dir: Path | None) -> dict[str, bytes]:
    """Everything the server wrote that a secret must not be in, by name: serve.log, /metrics,
    each data-dir file, each Ray log file."""
    places = {
        "serve.log": (work / "serve.log").read_bytes(),
        "/metrics": metrics,
    }
    roots = [("data", work / "data")]
    if session_dir is not None:
        roots.append(("ray", session_dir / "logs"))
    for label, root in roots:
        for p in sorted(root.rglob("*")):
            if p.is_file() and not p.is_symlink():
                try:
                    places[f"{label}/{p.relative_to(root)}"] = p.read_bytes()
                except OSError:  # a Ray log rotated away or a socket
                    continue
    return places


def secret_leaks(secrets: list[str], places: dict[str, bytes]) -> list[tuple[str, str]]:
    """(place, the secret's first 10 characters) for every secret found verbatim anywhere."""
    return [
        (where, s[:10] + "…")
        for s in secrets
        for where, data in places.items()
        if s.encode() in data
    ]


def server_traces(data_dir: Path, sessions: list[str]) -> dict[str, dict]:
    """Per session: rows by kind, rows by status, and request ids seen more than once."""
    db = sqlite3.connect(data_dir / "twinkle.db")
    out = {}
    for s in sessions:
        rows = db.execute(
            "SELECT request_id, kind, status FROM request_traces WHERE session_id = ?", (s,)
        ).fetchall()
        ids = Counter(r[0] for r in rows)
        out[s] = {
            "kinds": dict(Counter(r[1] for r in rows)),
            "status": dict(Counter(r[2] for r in rows)),
            "repeated_ids": sum(1 for n in ids.values() if n > 1),
        }
    db.close()
    return out


def vanished_requests(data_dir: Path, user_ids: list[int]) -> dict[str, int]:
    """The vanished clients' requests the server finished anyway, by status."""
    db = sqlite3.connect(data_dir / "twinkle.db")
    marks = ",".join("?" * len(user_ids))
    rows = db.execute(
        f"SELECT status, count(*) FROM request_traces WHERE user_id IN ({marks}) GROUP BY status",
        user_ids,
    ).fetchall()
    db.close()
    return dict(rows)


# ----------------------------------------------------------------------------------- clients


def make_keys(url: str, env: dict, n: int) -> tuple[str, list[tuple[str, int]]]:
    """An admin key, and ``n`` users with one key each made through the admin API: (key, user
    id)."""
    admin = subprocess.run(
        [TWINKLE, "keys", "create", "--user", "soak-admin", "--admin"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()[-1]
    keys = []
    with httpx.Client(base_url=url, headers={"X-API-Key": admin}, timeout=30) as http:
        for i in range(n):
            user = http.post("/api/v1/admin/users", json={"name": f"soak-{i}"})
            user.raise_for_status()
            key = http.post("/api/v1/admin/keys", json={"user_id": user.json()["id"]})
            key.raise_for_status()
            keys.append((key.json()["key"], user.json()["id"]))
    return admin, keys


def _worker(spec: dict, work: Path, tag: str, env: dict) -> tuple[subprocess.Popen, Path]:
    spec_file, out = work / f"{tag}.spec.json", work / f"{tag}.out.json"
    spec_file.write_text(json.dumps(spec))
    log = open(work / f"{tag}.log", "w")  # noqa: SIM115 (the worker writes it while it runs)
    proc = subprocess.Popen(
        [sys.executable, str(HERE / "soak_tenants.py"), str(spec_file), str(out)],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    return proc, out


def vanishers(url: str, slots: list[tuple[int, str]], seconds: float, work: Path, env) -> dict:
    """Keep one vanishing SDK client per slot running, each SIGKILLed 0.5-6 s after its first
    optimizer step (futures in flight), then replaced."""
    rng = random.Random(0)
    killed = Counter()
    deadline = time.monotonic() + seconds

    def slot(tenant: int, key: str) -> None:
        n = 0
        while time.monotonic() < deadline - 3:
            spec = {
                "url": url,
                "deadline_s": 600,
                "budget": 10**9,
                "tenants": [{"tenant": tenant, "role": "vanish", "key": key}],
            }
            proc, _ = _worker(spec, work, f"vanish{tenant}-{n}", env)
            log = work / f"vanish{tenant}-{n}.log"
            started = time.monotonic()  # killed once it trains (a step done), mid-run
            while time.monotonic() - started < 120 and "step " not in log.read_text():
                time.sleep(0.2)
            time.sleep(min(rng.uniform(0.5, 6), max(deadline - time.monotonic(), 0)))
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            killed[tenant] += 1
            n += 1

    threads = [threading.Thread(target=slot, args=s, daemon=True) for s in slots]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return {"killed": sum(killed.values()), "vanish_slots": len(slots)}


# ----------------------------------------------------------------------------------- report


def pct(values: list[float], q: float) -> float:
    return (
        statistics.quantiles(values, n=100, method="inclusive")[q - 1]
        if len(values) > 1
        else (values[0] if values else float("nan"))
    )


def jain(xs: list[float]) -> float:
    return sum(xs) ** 2 / (len(xs) * sum(x * x for x in xs)) if any(xs) else float("nan")


def report(books: list[dict], traces: dict, rss: list[dict], seconds: float, extra: dict) -> dict:
    by_role: dict[str, list[dict]] = defaultdict(list)
    for b in books:
        by_role[b["role"]].append(b)
    print(
        f"\n{len(books)} steady tenants + {extra['vanish_slots']} vanishing, {seconds:.0f} s; "
        f"vanishing clients killed: {extra['killed']}, their requests the server finished: "
        f"{extra.get('vanished_requests')}"
    )
    print(f"\n{'role':8} {'tenants':>7} {'issued':>7} {'completed':>9} {'failed':>6} {'lost':>5}")
    totals = Counter()
    for role, bs in sorted(by_role.items()):
        issued = sum(b["issued"] for b in bs)
        done = sum(b["completed"] for b in bs)
        failed = sum(sum(b["failed"].values()) for b in bs)
        totals.update(issued=issued, done=done, failed=failed)
        print(f"{role:8} {len(bs):7} {issued:7} {done:9} {failed:6} {issued - done - failed:5}")
    # the server's record against the client's, per session (roles with futures)
    lost = dup = repeated = 0
    for b in books:
        for s in b["sessions"]:
            server = traces.get(s, {"kinds": {}, "repeated_ids": 0})
            repeated += server["repeated_ids"]
            for kind, n in b["kinds"].items():
                diff = server["kinds"].get(kind, 0) - n
                lost, dup = lost + max(-diff, 0), dup + max(diff, 0)
    ok = sum(b["dedup_ok"] for b in books)
    bad = sum(b["dedup_bad"] for b in books)
    print(
        f"\nserver record vs client: futures lost {lost}, duplicated {dup}, request ids "
        f"logged twice {repeated}; retries answered with the first future {ok}, with another {bad}"
    )
    lat: dict[str, list[float]] = defaultdict(list)
    for b in books:
        for op, xs in b["latencies"].items():
            lat[op] += xs
    print(f"\n{'route':32} {'n':>6} {'p50 s':>8} {'p99 s':>8}")
    for op, xs in sorted(lat.items()):
        print(f"{op:32} {len(xs):6} {pct(xs, 50):8.3f} {pct(xs, 99):8.3f}")
    print(f"\n{'role':8} {'steps/tenant min..max':>22} {'min/max':>8} {'Jain':>6}")
    fairness = {}
    for role, bs in sorted(by_role.items()):
        steps = [float(b["steps"]) for b in bs]
        if role == "vanish" or not steps:
            continue
        ratio = min(steps) / max(steps) if max(steps) else float("nan")
        fairness[role] = {"steps": steps, "min_over_max": ratio, "jain": jain(steps)}
        span = f"{min(steps):.0f}..{max(steps):.0f}"
        print(f"{role:8} {span:>22} {ratio:8.2f} {jain(steps):6.3f}")
    start, end = rss[0], rss[-1]
    peak = {k: max(s.get(k, 0.0) for s in rss) for k in start}
    # the quarter points show whether growth levels off (the future store keeps results
    # future_ttl_seconds, then drops them) or keeps climbing
    quarters = [rss[min(len(rss) - 1, round(q * (len(rss) - 1)))] for q in (0.25, 0.5, 0.75)]
    print(
        f"\n{'process':14} {'RSS start MB':>12} {'25%':>6} {'50%':>6} {'75%':>6} {'end MB':>8} "
        f"{'peak MB':>8} {'growth':>7}"
    )
    for k in sorted(start):
        g = end.get(k, 0.0) / start[k] - 1 if start[k] else float("nan")
        mid = " ".join(f"{q.get(k, 0.0):6.0f}" for q in quarters)
        print(f"{k:14} {start[k]:12.0f} {mid} {end.get(k, 0.0):8.0f} {peak[k]:8.0f} {g:+7.1%}")
    errors = Counter()
    for b in books:
        errors.update({f"{b['role']}: {k}": v for k, v in b["failed"].items()})
    print("\nerrors by category:", dict(errors) or "none")
    print("server healthy afterwards:", extra["healthy"])
    checked = extra.get("secrets_checked", {})
    print(
        f"secrets: {checked.get('secrets')} API keys searched in {checked.get('places')} places "
        f"(serve.log, /metrics, data-dir files incl. the DB, Ray logs): "
        f"{extra.get('secret_leaks') or 'none found'}"
    )
    return {
        "tenants": len(books),
        "seconds": seconds,
        "totals": dict(totals),
        "lost": lost,
        "duplicated": dup,
        "repeated_ids": repeated,
        "retries_same_future": ok,
        "retries_other_future": bad,
        "latency": {
            op: {"n": len(xs), "p50": pct(xs, 50), "p99": pct(xs, 99)} for op, xs in lat.items()
        },
        "fairness": fairness,
        "rss_mb": {"start": start, "end": end, "peak": peak, "samples": rss},
        "errors": dict(errors),
        **extra,
        "books": books,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tenants", type=int, default=32)
    ap.add_argument("--seconds", type=float, default=600)
    ap.add_argument("--budget", type=int, default=100_000, help="optimizer steps per tenant")
    ap.add_argument("--workers", type=int, default=4, help="client processes (tenants as threads)")
    ap.add_argument("--quick", action="store_true", help="8 tenants, 60 s")
    ap.add_argument(
        "--future-ttl",
        type=float,
        help="the server's future_ttl_seconds (default 3600: finished results kept an hour, so "
        "the gateway's memory grows for the first hour of a soak)",
    )
    ap.add_argument("--json", help="also write the results here")
    a = ap.parse_args()
    if a.quick:
        a.tenants, a.seconds = 8, 60.0
    work = Path(tempfile.mkdtemp(prefix="soak-"))
    ttl = f"future_ttl_seconds: {a.future_ttl}\n" if a.future_ttl else ""
    (work / "config.yaml").write_text(f"models:\n  - name: {BASE}\n{ttl}")
    print(f"[soak] starting twinkle serve (work dir {work}) ...", file=sys.stderr, flush=True)
    proc, url, env, ready = start_server_config(work / "config.yaml", work)
    try:
        admin, keys = make_keys(url, env, a.tenants)
        roles = roles_for(a.tenants)
        tenants = [{"tenant": i, "role": r, "key": keys[i][0]} for i, r in enumerate(roles)]
        steady = [t for t in tenants if t["role"] != "vanish"]
        slots = [(t["tenant"], t["key"]) for t in tenants if t["role"] == "vanish"]
        print(
            f"[soak] ready in {ready:.0f} s; {a.tenants} tenants {dict(Counter(roles))} for "
            f"{a.seconds:.0f} s ...",
            file=sys.stderr,
            flush=True,
        )
        cenv = dict(env, PYTHONPATH=os.pathsep.join([str(HERE.parent), str(HERE)]))
        end = time.monotonic() + a.seconds
        workers = [
            _worker(
                {
                    "url": url,
                    "deadline_s": a.seconds,
                    "budget": a.budget,
                    "tenants": steady[w :: a.workers],
                },
                work,
                f"worker{w}",
                cenv,
            )
            for w in range(a.workers)
        ]
        time.sleep(min(20.0, a.seconds / 4))  # every tenant has started
        sampler = RssSampler(proc.pid)
        sampler.start()
        extra = vanishers(url, slots, end - time.monotonic(), work, cenv)
        books = []
        for w, (p, out) in enumerate(workers):
            p.wait()
            if not out.exists():
                raise SystemExit(
                    f"worker {w} wrote no result:\n{(work / f'worker{w}.log').read_text()[-3000:]}"
                )
            books += json.loads(out.read_text())
        rss = sampler.stop()
        time.sleep(2.5)  # request_traces are flushed every second
        sessions = [s for b in books for s in b["sessions"]]
        traces = server_traces(work / "data", sessions)
        gone = [keys[i][1] for i, r in enumerate(roles) if r == "vanish"]
        extra["vanished_requests"] = vanished_requests(work / "data", gone)
        extra["healthy"] = httpx.get(f"{url}/api/v1/healthz", timeout=10).status_code == 200
        # with the admin key: /metrics may be admin-only (gateway.metrics_require_admin)
        metrics = httpx.get(f"{url}/metrics", headers={"X-API-Key": admin}, timeout=30).content
        places = secret_places(work, metrics, ray_session_dir(proc.pid))
        secrets = [k for k, _ in keys] + [admin]
        extra["secret_leaks"] = secret_leaks(secrets, places)
        extra["secrets_checked"] = {"secrets": len(secrets), "places": len(places)}
        result = report(books, traces, rss, a.seconds, extra)
    finally:
        stop_server(proc)
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=2, default=str))
    bad = result["lost"] or result["duplicated"] or result["repeated_ids"] or result["secret_leaks"]
    return 1 if bad or result["retries_other_future"] or not result["healthy"] else 0


if __name__ == "__main__":
    sys.exit(main())
