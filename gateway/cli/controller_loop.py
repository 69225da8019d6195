"""Serve's controller at rest: a full reconcile once a second instead of ten times.

Ray Serve's controller runs its control loop every 0.1 s (``RAY_SERVE_CONTROL_LOOP_INTERVAL_S``):
each pass reads every node's info and resources from the GCS, deep-copies the applications'
target state and walks every replica. On an idle ``twinkle serve`` of the 25 M model that is the
largest CPU user of the whole server: controller 21-37 ms/s and, through those reads, a good part
of the GCS's 12-20 ms/s (benchmarks/README.md). On a small host those bursts stall the Trainer's
torch threads (they meet at a barrier after every parallel op), so they cost training about twice
their CPU share.

Raising the interval for good (``RAY_SERVE_CONTROL_LOOP_INTERVAL_S=0.5``) halves that but slows
every deploy, restart and shutdown, which advance one pass at a time (start-up 12.5 -> 15 s).
This keeps Ray's 0.1 s tick and skips the work of a tick while Serve is *quiet*: done
recovering, not shutting down, every application RUNNING and every deployment HEALTHY for the
last ``QUIET_AFTER_S``; then a full pass runs every ``quiet_loop_s`` (1 s by default) instead.
A deploy, a delete or a shutdown changes that state the moment the request arrives (an
application turns DEPLOYING or DELETING at once), so the next 0.1 s tick runs in full again:
start-up and shutdown keep their speed. What waits longer is only what a full pass discovers by
itself: a replica whose health check failed or whose actor died is seen up to ``quiet_loop_s``
later (Serve's health checks run every 10 s anyway).

How it gets into the controller: Serve calls the function named by
``RAY_SERVE_CONTROLLER_CALLBACK_IMPORT_PATH`` in the controller's process as it starts, and
``twinkle serve`` sets that (for a local Ray it starts, whose processes inherit its environment)
to :func:`install`. It replaces ``ServeController.run_control_loop_step`` with a wrapper; the
loop looks the method up on every pass. Written against Ray 2.60 (constraints.txt pins it):
anything it expects and does not find leaves the controller as Ray made it, with a warning in
the controller's log, and it never raises (a failing callback would fail ``serve.start``).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterable
from typing import Any

#: the controller's environment: seconds between full passes while quiet ("0" = every tick)
ENV = "TWINKLE_SERVE_QUIET_LOOP_S"
#: what ``twinkle serve`` puts in RAY_SERVE_CONTROLLER_CALLBACK_IMPORT_PATH
IMPORT_PATH = "gateway.cli.controller_loop.install"
#: Serve must have looked quiet on every full pass for this long before passes are skipped, so a
#: replica that just restarted (or a deploy that just finished) gets Ray's pace for a while
QUIET_AFTER_S = 5.0

log = logging.getLogger("ray.serve")


def is_quiet(
    recovered: bool,
    shutting_down: bool,
    app_statuses: Iterable[str],
    deployment_statuses: Iterable[str],
) -> bool:
    """Whether a controller in this state has nothing to drive: done recovering, not shutting
    down, every application RUNNING and every deployment HEALTHY."""
    return (
        recovered
        and not shutting_down
        and all(s == "RUNNING" for s in app_statuses)
        and all(s == "HEALTHY" for s in deployment_statuses)
    )


class QuietGate:
    """Decides, tick by tick, whether the next control-loop pass may be skipped.

    ``quiet_now`` is asked on every tick (it must be cheap); a pass is skipped only when Serve is
    quiet now, every full pass of the last ``quiet_after_s`` found it quiet too, and the last full
    pass was less than ``interval_s`` ago."""

    def __init__(
        self,
        interval_s: float,
        quiet_after_s: float = QUIET_AFTER_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.interval_s = interval_s
        self.quiet_after_s = quiet_after_s
        self._clock = clock
        self._last_full = float("-inf")
        self._busy_at = clock()  # start-up counts as busy
        self.skipped = 0

    def skip(self, quiet_now: bool) -> bool:
        now = self._clock()
        if (
            quiet_now
            and now - self._busy_at >= self.quiet_after_s
            and now - self._last_full < self.interval_s
        ):
            self.skipped += 1
            return True
        return False

    def ran(self, quiet_after: bool) -> None:
        """A full pass ran; ``quiet_after``: the state it left."""
        now = self._clock()
        self._last_full = now
        if not quiet_after:
            self._busy_at = now


def _controller_quiet(controller: Any) -> bool:
    # attribute names as in ray/serve/_private/controller.py (Ray 2.60); the status enums are
    # str subclasses, so they compare equal to their names
    apps = controller.application_state_manager._application_states.values()
    deployments = controller.deployment_state_manager._deployment_states.values()
    return is_quiet(
        controller.done_recovering_event.is_set(),
        controller._shutting_down,
        (a.status for a in apps),
        (d.curr_status_info.status for d in deployments),
    )


def _classes(cls: type) -> list[type]:
    """``cls`` and its subclasses. ``ray.remote`` runs an actor as a subclass of the class it was
    given, with the methods re-bound to tracing wrappers on that subclass, so patching only
    ``ServeController`` itself would be shadowed."""
    out = [cls]
    for sub in cls.__subclasses__():
        out += _classes(sub)
    return out


def _wrap(klass: type, gate: QuietGate) -> None:
    original = klass.__dict__["run_control_loop_step"]
    if getattr(original, "_twinkle_quiet", False):
        return

    async def run_control_loop_step(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            if gate.skip(_controller_quiet(self)):
                return None
        except Exception:  # Serve's internals changed: run every pass, as Ray would
            log.warning("twinkle quiet control loop: state unreadable", exc_info=True)
            klass.run_control_loop_step = original  # type: ignore[attr-defined]
        result = await original(self, *args, **kwargs)
        try:
            gate.ran(_controller_quiet(self))
        except Exception:
            gate.ran(False)
        return result

    run_control_loop_step._twinkle_quiet = True  # type: ignore[attr-defined]
    klass.run_control_loop_step = run_control_loop_step  # type: ignore[attr-defined]


#: the gate of the installed wrapper (one controller per process), for tests and logs
GATE: QuietGate | None = None


def install() -> None:
    """The controller callback: wrap the control-loop step (see the module docstring)."""
    global GATE
    try:
        interval = float(os.environ.get(ENV, "1.0"))
        from ray.serve._private import controller as mod

        tick = float(getattr(mod, "CONTROL_LOOP_INTERVAL_S", 0.1))
        if interval <= tick or GATE is not None:
            return
        GATE = QuietGate(interval)
        for klass in _classes(mod.ServeController):
            if "run_control_loop_step" in klass.__dict__:
                _wrap(klass, GATE)
        log.info("twinkle: a full control-loop pass every %gs while Serve is quiet", interval)
    except Exception:  # never fail the controller's start
        log.warning("twinkle quiet control loop not installed", exc_info=True)
