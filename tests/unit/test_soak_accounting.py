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
