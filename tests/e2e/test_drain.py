"""Graceful drain of `twinkle serve` on SIGTERM, and readiness vs liveness: forward_backward
requests accepted before the signal finish and their results are collected, new requests get 503
with Retry-After while the server drains, readiness turns 503 while liveness stays 200, and the
process exits 0."""

from __future__ import annotations

import re
import signal
import time

import httpx
import pytest
import tinker
from tinker import types

from tests.e2e.conftest import stop_server

pytestmark = pytest.mark.e2e
#: the test stops the ``observed`` profile's server: the profile's other tests run first
LAST_ON_ITS_SERVER = True
BASE = "twinkle/tiny-chat"
#: four large steps (32 rows x 500 tokens each) keep the Trainer busy for seconds on CPU
ROWS, LENGTH, STEPS = 32, 500, 4


def _pending(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=5).text
    m = re.search(r"^twinkle_futures_pending(?:\{[^}]*\})? (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def _accepted_steps(url: str) -> float:
    """forward_backward requests the server has answered 200 (accepted as futures)."""
    text = httpx.get(f"{url}/metrics", timeout=5).text
    pat = (
        r'^twinkle_http_requests_total\{[^}]*route="/api/v1/forward_backward"'
        r'[^}]*status="200"[^}]*\} (\S+)$'
    )
    m = re.search(pat, text, re.M)
    return float(m.group(1)) if m else 0.0


@pytest.fixture
def observed(pool, start_observed):
    """The pool's ``observed`` profile (`OBSERVED_CONFIG`: a 120 s drain window, Retry-After 7),
    taken out of the pool: this test stops it. Ready first: a test before this one may have
    killed a replica that Serve is still replacing."""
    srv, log = pool.take("observed", start_observed)
    deadline = time.monotonic() + 60
    while httpx.get(f"{srv.url}/api/v1/readyz", timeout=15).status_code != 200:
        if time.monotonic() > deadline:
            break  # the test's own readiness assertion reports it
        time.sleep(0.5)
    try:
        yield srv, log
    finally:
        stop_server(srv, log)


def test_sigterm_drains_in_flight_work_and_exits_0(observed):
    srv, log = observed
    key = srv.create_key("alice")
    live = httpx.get(f"{srv.url}/api/v1/livez", timeout=5)
    ready = httpx.get(f"{srv.url}/api/v1/readyz", timeout=15)
    assert (live.status_code, ready.status_code) == (200, 200), ready.text
    sc = tinker.ServiceClient(base_url=srv.url, api_key=key)
    tc = sc.create_lora_training_client(base_model=BASE, rank=4, seed=1)
    row = [(7 * i) % 1500 + 10 for i in range(LENGTH)]
    data = [
        types.Datum(
            model_input=types.ModelInput.from_ints(row[:-1]),
            loss_fn_inputs={"target_tokens": row[1:], "weights": [1.0] * (LENGTH - 1)},
        )
        for _ in range(ROWS)
    ]
    before = _accepted_steps(srv.url)  # the server may have served other tests
    futures = [tc.forward_backward(data, "cross_entropy") for _ in range(STEPS)]
    deadline = time.monotonic() + 30
    # SIGTERM only once the server has accepted every step: the SDK submits them in the
    # background, and one submitted after the signal is (rightly) refused with 503
    while _accepted_steps(srv.url) < before + STEPS or _pending(srv.url) < 1:
        assert time.monotonic() < deadline, "forward_backward never reached the server"
        time.sleep(0.05)

    srv.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 20
    while True:  # readiness turns 503 within a poll or two (0.5 s each)
        ready = httpx.get(f"{srv.url}/api/v1/readyz", timeout=15)
        if ready.status_code == 503:
            break
        assert time.monotonic() < deadline, "readyz never reported draining"
        time.sleep(0.1)
    assert ready.json()["status"] == "draining" and ready.json()["pending"] >= 1
    assert httpx.get(f"{srv.url}/api/v1/livez", timeout=5).status_code == 200
    new = httpx.post(
        f"{srv.url}/api/v1/create_session",
        headers={"X-API-Key": key},
        json={"tags": [], "sdk_version": "0.38.0"},
        timeout=15,
    )
    assert new.status_code == 503 and new.headers["retry-after"] == "7", new.text
    assert new.json()["error"]["code"] == "draining"

    losses = [f.result().metrics["loss:sum"] for f in futures]  # all finish
    assert len(losses) == STEPS and all(x > 0 for x in losses)
    assert srv.proc.wait(timeout=120) == 0
    out = log.text()
    assert "Drained: no request in flight" in out
