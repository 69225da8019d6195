"""`twinkle serve`'s side of a drain (gateway/cli/serve.py, `_drain`): it waits until every
gateway replica reports no pending future, then only as long as finished results are still
uncollected (at most `DRAIN_COLLECT_S`), and stops at once when there are none. The replicas'
reports come through a fake of Ray's internal KV, scripted over time."""

from __future__ import annotations

import json
import time
from collections.abc import Callable

import pytest

from gateway.cli import serve as serve_mod
from gateway.config import ServerConfig


class _ScriptedKV:
    """Ray's internal KV as `_drain` uses it; each replica's status is ``script(seconds since the
    drain flag was set)`` -> (pending, uncollected)."""

    def __init__(self, scripts: list[Callable[[float], tuple[int, int]]]) -> None:
        self.scripts = scripts
        self.flag_at: float | None = None

    def _internal_kv_put(self, key: bytes, value: bytes) -> None:
        assert key == serve_mod.DRAIN_FLAG
        self.flag_at = time.monotonic()

    def _internal_kv_list(self, prefix: bytes) -> list[bytes]:
        assert prefix == serve_mod.DRAIN_STATUS
        return [prefix + str(i).encode() for i in range(len(self.scripts))]

    def _internal_kv_get(self, key: bytes) -> bytes:
        assert self.flag_at is not None
        i = int(key[len(serve_mod.DRAIN_STATUS) :])
        pending, uncollected = self.scripts[i](time.monotonic() - self.flag_at)
        status = {"pending": pending, "uncollected": uncollected, "t": time.time()}
        return json.dumps(status).encode()


def _drain(monkeypatch, scripts, replicas: int = 1, timeout: float = 30) -> float:
    monkeypatch.setattr(serve_mod, "_kv", lambda: _ScriptedKV(scripts))
    config = ServerConfig.model_validate(
        {"drain_timeout_seconds": timeout, "gateway": {"num_replicas": replicas}}
    )
    t0 = time.monotonic()
    serve_mod._drain(config)
    return time.monotonic() - t0


def test_nothing_to_collect_stops_at_once(monkeypatch, capsys) -> None:
    took = _drain(monkeypatch, [lambda t: (0, 0)])
    assert took < 1.5  # not DRAIN_COLLECT_S (2 s): nothing is left to collect
    assert capsys.readouterr().out.strip() == "Drained: no request in flight"


def test_waits_for_pending_then_for_collection(monkeypatch, capsys) -> None:
    # finishes at 0.6 s, its client collects the result at 1.0 s
    took = _drain(monkeypatch, [lambda t: (1 if t < 0.6 else 0, 1 if 0.6 <= t < 1.0 else 0)])
    assert 1.0 <= took < 2.0  # no 2 s sleep once nothing is pending (that would be 2.6 s)
    assert capsys.readouterr().out.strip() == "Drained: no request in flight"


def test_an_uncollected_result_is_waited_for_at_most_the_collect_window(
    monkeypatch, capsys
) -> None:
    monkeypatch.setattr(serve_mod, "DRAIN_COLLECT_S", 0.6)
    took = _drain(monkeypatch, [lambda t: (0, 2)])
    assert 0.6 <= took < 1.5
    out = capsys.readouterr().out
    assert "Drained: no request in flight" in out
    assert "2 finished result(s) not collected within 0.6s" in out


def test_every_replica_must_report(monkeypatch, capsys) -> None:
    # the second replica still has a request in flight until 0.5 s
    took = _drain(monkeypatch, [lambda t: (0, 0), lambda t: (1 if t < 0.5 else 0, 0)], replicas=2)
    assert 0.5 <= took < 1.5
    assert "Drained" in capsys.readouterr().out


@pytest.mark.parametrize("pending", [1, None])
def test_timeout_names_what_was_in_flight(monkeypatch, capsys, pending) -> None:
    scripts = [lambda t: (1, 0)] if pending else []  # no replica ever reports: unknown
    took = _drain(monkeypatch, scripts, timeout=0.5)
    assert 0.5 <= took < 1.5
    out = capsys.readouterr().out
    assert "Drain timed out after 0.5s with " in out
    assert ("1 request(s)" if pending else "an unknown number of request(s)") in out
    assert "Drained" not in out


def test_every_replica_we_deploy_polls_its_shutdown_quickly() -> None:
    """Serve's default 2 s wait loop made each shutdown tier (gateway, then engines) take over
    2 s even when idle."""
    from engine.app import sampler_app, trainer_app
    from engine.config import SHUTDOWN_WAIT_LOOP_S, ModelConfig

    model = ModelConfig(name="twinkle/tiny-chat")
    gateway = serve_mod.gateway_deployment(ServerConfig())
    deployments = [
        gateway,
        trainer_app(model, "/tmp/x", gap_timeout=1.0)._bound_deployment,
        sampler_app(model, "/tmp/x")._bound_deployment,
    ]
    assert SHUTDOWN_WAIT_LOOP_S <= 0.2
    for d in deployments:
        assert d._deployment_config.graceful_shutdown_wait_loop_s == SHUTDOWN_WAIT_LOOP_S, d.name
