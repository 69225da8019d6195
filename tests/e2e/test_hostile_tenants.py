"""A hostile tenant cannot hurt honest ones, on the pool's ``hosted`` profile (two gateway replicas,
JWT, Postgres, fused execution of the tiny chat model's Trainer).

Two honest tenants train and sample in a loop with the unmodified Tinker SDK
(tests/e2e/hostile_watch.py) while a third, capped at 2 training clients and 3 checkpoints, sends
each attack of tests/e2e/hostile_attacks.py in turn. Every attack is refused or contained; every
honest step succeeds; the honest tenants' median step time under each attack (both tenants' steps
pooled) stays within 2x of their undisturbed median; healthz answers 200 throughout; and the
server's memory (the RSS of its whole process tree) is back within 256 MiB of its undisturbed
level a minute after the last attack.
"""

from __future__ import annotations

import time

import pytest

from tests.e2e.hosted_profile import set_quotas
from tests.e2e.hostile_attacks import ATTACKS, Arena
from tests.e2e.hostile_watch import Honest, Watch, median_seconds

pytestmark = pytest.mark.e2e
#: steps each honest tenant runs undisturbed first, and at least during each attack
UNDISTURBED_STEPS, STEPS_PER_ATTACK = 6, 3
MEMORY_SLACK = 256 * 2**20


@pytest.fixture(scope="module")
def arena(pool, start_hosted):
    srv = pool.get("hosted", start_hosted)
    attacker = srv.create_key("mallory")
    set_quotas(srv, "mallory", max_training_clients=2, max_checkpoints=3)
    honest = [srv.create_key(f"honest-{i}") for i in range(2)]
    return srv, Arena(
        srv.url, str(srv.data_dir), attacker, srv.create_key("ops", admin=True), honest
    )


def test_a_hostile_tenant_cannot_hurt_honest_ones(arena) -> None:
    srv, a = arena
    tenants = [Honest(srv.url, key) for key in a.honest]
    watch = Watch(srv.url, srv.proc.pid)
    for t in tenants:
        t.start()
    watch.start()
    try:
        for t in tenants:
            t.wait_steps("undisturbed", UNDISTURBED_STEPS)
        t_attacks = time.monotonic()
        baseline_rss = max(rss for t, rss in watch.memory if t < t_attacks)
        for attack in ATTACKS:
            for t in tenants:
                t.phase = attack.__name__
            attack(a)
            for t in tenants:  # the attack's effects, if any, reach a few honest steps
                t.wait_steps(attack.__name__, STEPS_PER_ATTACK)
        for t in tenants:
            t.phase = "after"
        deadline = time.monotonic() + 60
        while watch.tree_rss() > baseline_rss + MEMORY_SLACK and time.monotonic() < deadline:
            time.sleep(1)
        final_rss = watch.tree_rss()
    finally:
        watch.stop()
        for t in tenants:
            t.stop()

    # both tenants' steps pooled per phase: a median of 6+ steps, not of 3, so one step slowed by
    # the test process's own sending (8 x 48 MiB on the same cores) does not decide it
    base = median_seconds([s for t in tenants for s in t.steps_in("undisturbed")])
    rows = []
    for attack in ATTACKS:
        steps = [s for t in tenants for s in t.steps_in(attack.__name__)]
        rows.append((attack.__name__, base, median_seconds(steps), len(steps)))
    print(f"\n{'attack':52} {'undisturbed s':>14} {'under attack s':>15} {'steps':>6}")
    for name, b, under, n in rows:
        print(f"{name:52} {b:14.2f} {under:15.2f} {n:6d}")
    print(f"server tree RSS: {baseline_rss / 2**20:.0f} MiB before, {final_rss / 2**20:.0f} after")

    errors = [(s.phase, s.error) for t in tenants for s in t.steps if s.error]
    assert not errors, errors
    slow = [(name, base, under) for name, base, under, _ in rows if under > 2 * base]
    assert not slow, slow
    assert not watch.bad_health(), watch.bad_health()[:10]
    assert final_rss <= baseline_rss + MEMORY_SLACK, (baseline_rss, final_rss)
