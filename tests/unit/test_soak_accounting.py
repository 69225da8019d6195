"""The soak's bookkeeping (benchmarks/soak.py): the role mix, and that the report's comparison of
the server's record with the client's books finds lost and duplicated futures and repeated request
ids. (The soak itself is a benchmark, run by hand: numbers in benchmarks/README.md.)"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import soak  # noqa: E402


@pytest.mark.parametrize("n", [1, 3, 8, 13, 32, 64])
def test_roles_keep_the_mix(n):
    roles = soak.roles_for(n)
    assert len(roles) == n and "vanish" in roles
    if n == 32:
        assert Counter(roles) == Counter(soak.MIX)


def _book(kinds: dict, sessions=("s1",), issued=None, completed=None) -> dict:
    n = sum(kinds.values())
    return {
        "tenant": 0,
        "role": "sft",
        "latencies": {"forward_backward": [0.1, 0.2, 0.3]},
        "issued": n if issued is None else issued,
        "completed": n if completed is None else completed,
        "failed": {},
        "kinds": kinds,
        "steps": 3,
        "dedup_ok": 0,
        "dedup_bad": 0,
        "sessions": list(sessions),
        "errors": [],
    }


EXTRA = {"killed": 0, "vanish_slots": 0, "healthy": True}
RSS = [{"gateway": 100.0}, {"gateway": 110.0}]


def _report(book, server_kinds, repeated=0):
    traces = {"s1": {"kinds": server_kinds, "status": {}, "repeated_ids": repeated}}
    return soak.report([book], traces, RSS, 10.0, dict(EXTRA))


def test_report_matches_the_server_record():
    kinds = {"create_model": 1, "forward_backward": 3, "optim_step": 3}
    out = _report(_book(kinds), dict(kinds))
    assert (out["lost"], out["duplicated"], out["repeated_ids"]) == (0, 0, 0)


def test_report_finds_lost_duplicated_and_repeated():
    kinds = {"create_model": 1, "forward_backward": 3, "optim_step": 3}
    out = _report(_book(kinds), {"create_model": 1, "forward_backward": 2, "optim_step": 5}, 1)
    assert (out["lost"], out["duplicated"], out["repeated_ids"]) == (1, 2, 1)


def test_report_counts_what_the_client_never_saw_resolve(capsys):
    kinds = {"forward_backward": 4}
    _report(_book(kinds, issued=4, completed=3), dict(kinds))
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("sft"))
    assert row.split()[-1] == "1"  # issued 4, completed 3, failed 0: one lost by the client


def test_fairness_index():
    assert soak.jain([5.0, 5.0, 5.0]) == pytest.approx(1.0)
    assert soak.jain([10.0, 0.0]) == pytest.approx(0.5)


def test_secret_scan_finds_a_key_in_any_file_the_server_wrote(tmp_path):
    (tmp_path / "serve.log").write_text("started\n")
    data = tmp_path / "data" / "exports" / "traces"
    data.mkdir(parents=True)
    (data / "t.json").write_text('{"ok": 1}')
    session = tmp_path / "session"
    (session / "logs").mkdir(parents=True)
    (session / "logs" / "worker.err").write_bytes(b"\x00binary\x00")

    def places():
        return soak.secret_places(tmp_path, b"# metrics\n", session)

    keys = ["tml-" + "a" * 40, "tml-" + "b" * 40]
    assert soak.secret_leaks(keys, places()) == []
    assert {"serve.log", "/metrics", "data/exports/traces/t.json", "ray/worker.err"} == set(
        places()
    )
    (session / "logs" / "worker.err").write_bytes(b"\x00auth " + keys[1].encode() + b"\x00")
    assert soak.secret_leaks(keys, places()) == [("ray/worker.err", keys[1][:10] + "…")]


def test_ray_session_dir_comes_from_a_raylet_command_line(tmp_path):
    import subprocess
    import sys as _sys

    child = subprocess.Popen(
        [_sys.executable, "-c", "import time; time.sleep(30)", f"--session_dir={tmp_path}"]
    )
    try:
        found = None
        for _ in range(50):  # the child's cmdline is readable once it has exec'd
            # the child as root: this pytest process may have a real Ray cluster below it
            found = soak.ray_session_dir(child.pid)
            if found is not None:
                break
            import time

            time.sleep(0.1)
        assert found == tmp_path
    finally:
        child.kill()
        child.wait()
