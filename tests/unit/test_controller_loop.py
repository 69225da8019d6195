"""gateway/cli/controller_loop.py: when Serve's controller may skip a control-loop pass.

The wrapper inside a real Serve controller is covered by tests/e2e/test_controller_loop.py."""

from __future__ import annotations

import pytest

from gateway.cli.controller_loop import QuietGate, is_quiet


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


@pytest.mark.parametrize(
    ("recovered", "shutting_down", "apps", "deployments", "quiet"),
    [
        (True, False, ["RUNNING"], ["HEALTHY", "HEALTHY"], True),
        (True, False, [], [], True),  # nothing deployed: nothing to drive
        (False, False, ["RUNNING"], ["HEALTHY"], False),  # still recovering after a restart
        (True, True, ["RUNNING"], ["HEALTHY"], False),  # serve.shutdown() asked
        (True, False, ["DEPLOYING"], ["HEALTHY"], False),  # serve.run() of a new version
        (True, False, ["DELETING"], ["HEALTHY"], False),
        (True, False, ["RUNNING"], ["HEALTHY", "UPDATING"], False),
        (True, False, ["RUNNING"], ["UNHEALTHY"], False),  # a replica failed its health check
        (True, False, ["RUNNING"], ["UPSCALING"], False),
    ],
)
def test_is_quiet(recovered, shutting_down, apps, deployments, quiet) -> None:
    assert is_quiet(recovered, shutting_down, apps, deployments) is quiet


def _ticks(gate: QuietGate, clock: Clock, quiet: bool, n: int, tick: float = 0.1) -> int:
    """``n`` control-loop ticks of ``tick`` s in a state that is ``quiet``: how many ran in full."""
    full = 0
    for _ in range(n):
        if not gate.skip(quiet):
            gate.ran(quiet)
            full += 1
        clock.t += tick
    return full


def test_quiet_serve_gets_one_full_pass_per_interval() -> None:
    clock = Clock()
    gate = QuietGate(1.0, quiet_after_s=5.0, clock=clock)
    # start-up counts as busy: Ray's pace (every tick) for the first 5 s even if quiet
    assert _ticks(gate, clock, True, 50) == 50
    # then one full pass a second: 10 s of ticks, 10 full passes (not 100)
    assert _ticks(gate, clock, True, 100) == 10
    assert gate.skipped == 90


def test_a_busy_state_is_seen_on_the_next_tick_and_keeps_the_pace_for_a_while() -> None:
    clock = Clock()
    gate = QuietGate(1.0, quiet_after_s=5.0, clock=clock)
    _ticks(gate, clock, True, 100)
    # a deploy or a shutdown turns the state busy the moment it is asked: the next tick runs
    assert _ticks(gate, clock, False, 1) == 1
    assert _ticks(gate, clock, False, 20) == 20  # every tick while busy
    # quiet again: every tick for 5 s more (a replica that just started), then slow
    assert _ticks(gate, clock, True, 49) == 49
    assert _ticks(gate, clock, True, 30) <= 4


def test_a_busy_state_found_by_a_full_pass_restarts_the_quiet_period() -> None:
    """A replica that dies is only noticed by a full pass (its health check): that pass leaves
    the state busy, and from then on every tick runs."""
    clock = Clock()
    gate = QuietGate(1.0, quiet_after_s=5.0, clock=clock)
    _ticks(gate, clock, True, 100)
    clock.t += 1.0  # the next tick is due a full pass
    assert not gate.skip(True)
    gate.ran(False)  # it found the dead replica
    clock.t += 0.1
    assert not gate.skip(True)  # quiet-looking, but within 5 s of a busy pass


@pytest.mark.parametrize(("interval", "installed"), [("1", True), ("0.1", False), ("0", False)])
def test_install_wraps_the_step_only_for_an_interval_above_the_tick(
    monkeypatch, interval, installed
) -> None:
    """Ray 2.60's ServeController and the subclass ``ray.remote`` makes of it (it re-binds the
    methods there, so the subclass is what a running controller calls)."""
    import ray
    from ray.serve._private import controller as mod

    from gateway.cli import controller_loop

    remote = ray.remote(num_cpus=0)(mod.ServeController)  # defines the subclass
    del remote
    classes = controller_loop._classes(mod.ServeController)
    assert len(classes) >= 2
    before = {k: k.__dict__.get("run_control_loop_step") for k in classes}
    monkeypatch.setenv(controller_loop.ENV, interval)
    monkeypatch.setattr(controller_loop, "GATE", None)
    try:
        controller_loop.install()
        for k in classes:
            step = k.__dict__.get("run_control_loop_step")
            if before[k] is not None:
                assert getattr(step, "_twinkle_quiet", False) is installed, k
        assert (controller_loop.GATE is not None) is installed
    finally:
        for k, step in before.items():
            if step is not None:
                k.run_control_loop_step = step
