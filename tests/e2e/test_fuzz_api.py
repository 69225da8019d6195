"""The whole HTTP API fuzzed against a real `twinkle serve` (the pool's ``hosted`` profile: its
engine, on Postgres, behind two gateway replicas; quotas lifted for the fuzz users): schemathesis
over /openapi.json (coverage, fuzzing and stateful phases) as a user and as an admin, so every
operation is reached past auth; then our own generator over the protobuf and streaming routes,
and seeded custom losses built to allocate or to spin (tests/e2e/fuzz_inputs.py).
No 5xx, no response slower than the request timeout, and the server healthy afterwards.

Budgets: ``TWINKLE_FUZZ_SECONDS`` per schemathesis run (default 45, CI's), ``TWINKLE_FUZZ_COUNT``
generated protobuf / stream bodies (default 120 / 30), ``TWINKLE_FUZZ_SEED`` (default fixed, so
CI replays; set it to explore). A longer run: ``TWINKLE_FUZZ_SECONDS=900 TWINKLE_FUZZ_COUNT=2000
bash scripts/test.sh tests/e2e/test_fuzz_api.py``. Reports (JUnit, and the failing cases'
`curl` lines in the output) go to the test's tmp dir.

Excluded from schemathesis: ``DELETE /api/v1/auth/apikey/me`` (it revokes the very key the
fuzzer authenticates with, after which every request is a 401: that is how an earlier run
reached only 18 of 81 operations past auth) and, for the admin, key revocation and disabling users
or orgs (it would lock itself out the same way). Those routes have their own tests
(tests/gateway/test_admin_api.py, test_auth.py).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import tinker
from tinker import types

from tests.e2e.fuzz_inputs import (
    SEQ_EDGE,
    SUMMED_SPARSE,
    hostile_losses,
    proto_bodies,
    stream_bodies,
)
from tests.e2e.hosted_profile import set_quotas

pytestmark = pytest.mark.e2e
#: the admin fuzz changes server-wide state (org quotas, users, orgs): the hosted profile's other
#: tests run first (tests/e2e/conftest.py `_group`)
LAST_ON_ITS_SERVER = True
BASE = "twinkle/tiny-chat"
SECONDS = int(os.environ.get("TWINKLE_FUZZ_SECONDS", "45"))
COUNT = int(os.environ.get("TWINKLE_FUZZ_COUNT", "120"))
SEED = int(os.environ.get("TWINKLE_FUZZ_SEED", "20261205"))
REQUEST_TIMEOUT_S = 60  # retrieve_future long-polls up to 25 s; anything slower is a hang
ST = str(Path(sys.executable).with_name("st"))
_SELF_LOCKOUT = ["--exclude-path", "/api/v1/auth/apikey/me"]
_ADMIN_LOCKOUT = [
    "--exclude-path-regex",
    r"^/api/v1/admin/(keys/\{key_id\}/revoke|users/\{user_id\}|orgs/\{org_id\})$",
]


#: the fuzz users' quotas: past anything the fuzz sends, so that a request fails on its contents,
#: not on the hosted profile's default quotas (4 training clients, rank 32, 50k tokens a minute)
UNLIMITED = {
    "max_training_clients": 10**9,
    "max_lora_rank": 10**9,
    "sample_tokens_per_minute": 10**12,
    "train_tokens_per_minute": 10**12,
}


@pytest.fixture(scope="module")
def fuzz_server(pool, start_hosted):
    """The hosted profile's server: Postgres (the production database: it enforces what SQLite
    lets through, 32-bit INTEGER ids, VARCHAR lengths, no NUL in text; the values SQLite alone
    refuses, past 64 bits, are bounded on the wire for both), two gateway replicas sharing Redis,
    JWT mode on (an API key is still a credential on every route)."""
    return pool.get("hosted", start_hosted)


def _fuzz_key(srv, user: str, admin: bool = False) -> str:
    key = srv.create_key(user, admin=admin)
    set_quotas(srv, user, **UNLIMITED)
    return key


def _schemathesis(url: str, key: str, seed: int, extra: list[str], report: Path) -> str:
    cmd = [
        ST,
        "run",
        f"{url}/openapi.json",
        "-H",
        f"X-API-Key: {key}",
        "--phases",
        "coverage,fuzzing,stateful",
        "--checks",
        "not_a_server_error",
        "--max-response-time",
        str(REQUEST_TIMEOUT_S),
        "--request-timeout",
        str(REQUEST_TIMEOUT_S + 5),
        "--max-time",
        str(SECONDS),
        "--max-examples",
        "25",
        "--seed",
        str(seed),
        "--report",
        "junit",
        "--report-junit-path",
        str(report),
        "--no-color",
        *extra,
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=SECONDS + 600)
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-12000:]
    return text


def _healthy(srv) -> None:
    """The server still answers, and a new tenant can train a step."""
    assert httpx.get(f"{srv.url}/api/v1/healthz", timeout=10).status_code == 200
    sc = tinker.ServiceClient(base_url=srv.url, api_key=srv.create_key("after-fuzz"))
    tc = sc.create_lora_training_client(base_model=BASE, rank=4).result()
    datum = types.Datum(
        model_input=types.ModelInput.from_ints([5, 6, 7]),
        loss_fn_inputs={"target_tokens": [6, 7, 8], "weights": [1.0, 1.0, 1.0]},
    )
    assert tc.forward_backward([datum], "cross_entropy").result().metrics["loss:sum"] > 0
    sc.close("success")


@pytest.mark.parametrize("role", ["user", "admin"])
def test_schemathesis_finds_no_server_error(fuzz_server, tmp_path, role) -> None:
    key = _fuzz_key(fuzz_server, f"fuzz-{role}", admin=role == "admin")
    extra = _SELF_LOCKOUT + (_ADMIN_LOCKOUT if role == "admin" else [])
    text = _schemathesis(fuzz_server.url, key, SEED, extra, tmp_path / "junit.xml")
    tested = int(re.search(r"Tested: (\d+)", text).group(1))  # type: ignore[union-attr]
    generated = int(re.search(r"(\d+) generated", text).group(1))  # type: ignore[union-attr]
    print(f"schemathesis as {role}: {tested} operations, {generated} cases")
    assert tested >= 80 and generated >= 500
    # past auth: the only operations never answered with anything but 401/403 are the signed
    # downloads (the signature is the credential) and, for a user key, the admin ones
    refused = re.findall(r"^\s*- [A-Z]+ (/\S+)$", _section(text, "Authentication failed"), re.M)
    allowed = _SIGNED if role == "admin" else _SIGNED + _ADMIN_ONLY
    assert all(p.startswith(allowed) for p in refused), refused
    _healthy(fuzz_server)


_SIGNED = ("/api/v1/session_traces/", "/api/v1/external_weights/")
_ADMIN_ONLY = ("/api/v1/admin/", "/api/v1/audit", "/api/v1/billing/")


def _section(text: str, title: str) -> str:
    """The lines of the report's warning section ``title`` (up to the next blank-line-led tip)."""
    start = text.find(title)
    return "" if start < 0 else text[start : text.find("💡", start)]


def test_protobuf_and_streaming_routes_survive_hostile_bodies(fuzz_server) -> None:
    key = _fuzz_key(fuzz_server, "fuzz-proto")
    sc = tinker.ServiceClient(base_url=fuzz_server.url, api_key=key)
    tc = sc.create_lora_training_client(base_model=BASE, rank=4).result()
    headers = {"X-API-Key": key, "Content-Type": "application/x-protobuf"}
    seen: dict[str, int] = {}
    expected_seq, reached_engine = 1, 0
    with httpx.Client(base_url=fuzz_server.url, timeout=REQUEST_TIMEOUT_S) as http:
        for what, payload in proto_bodies(SEED, tc.model_id, COUNT):
            if not isinstance(payload, bytes):
                if what != SEQ_EDGE:
                    payload.seq_id = expected_seq
                payload = payload.SerializeToString()
            route = "/api/v1/forward" if len(seen) % 5 == 4 else "/api/v1/forward_backward"
            r = http.post(route, content=payload, headers=headers)
            seen[what] = seen.get(what, 0) + 1
            assert r.status_code < 500, (what, r.status_code, r.text)
            if what == SUMMED_SPARSE:
                assert r.status_code == 413, (what, r.status_code, r.text)
            if r.status_code in (200, 413) and what != SEQ_EDGE:
                expected_seq += 1  # a 413 over a size limit passes its seq_id in order too
            if r.status_code == 200 and what != SEQ_EDGE:
                reached_engine += 1
                _settles(http, key, r.json()["request_id"], what)
        n_stream = max(10, COUNT // 4)
        for what, route, body in stream_bodies(SEED, BASE, n_stream):
            start = time.monotonic()
            with http.stream("POST", route, json=body, headers={"X-API-Key": key}) as r:
                for _ in r.iter_bytes():
                    pass
            assert r.status_code < 500, (what, r.status_code)
            assert time.monotonic() - start < REQUEST_TIMEOUT_S, what
    print(f"protobuf bodies: {sum(seen.values())} ({reached_engine} reached the Trainer): {seen}")
    assert reached_engine >= 5  # the hostile-contents cases did get past the gateway
    sc.close("success")
    _healthy(fuzz_server)


def test_custom_losses_built_to_allocate_or_spin_are_bounded(fuzz_server) -> None:
    """Seeded losses chaining outer products, K x K selections, nuclear norms, long chains and
    joins over inputs of up to 65,536 elements: each runs or is refused as the user's error,
    within `LOSS_DEADLINE_S`, and the server stays healthy."""
    key = _fuzz_key(fuzz_server, "fuzz-losses")
    sc = tinker.ServiceClient(base_url=fuzz_server.url, api_key=key)
    tc = sc.create_lora_training_client(base_model=BASE, rank=4).result()
    outcomes: dict[str, int] = {}
    handles: dict[str, object] = {}  # the SDK refuses a second upload of the same traced loss
    for what, fn, x in hostile_losses(SEED, max(8, COUNT // 10)):
        datum = types.Datum(
            model_input=types.ModelInput.from_ints([5, 6, 7]),
            loss_fn_inputs={"target_tokens": [6, 7, 8], "x": types.TensorData.from_numpy(x)},
        )
        start = time.monotonic()
        try:
            steps = what.split(" over ")[0]
            if steps not in handles:
                handles[steps] = sc.create_custom_loss(fn, {"logprobs": 1, "x": 1}).result()
            tc.forward_backward_custom([datum], handles[steps]).result()
            outcome = "ran"
        except tinker.APIStatusError as exc:
            assert exc.status_code < 500, (what, exc)
            outcome = f"refused {exc.status_code}"
        except Exception as exc:  # a failed future: the SDK raises the user's error
            assert "node" in str(exc) or "index" in str(exc).lower(), (what, exc)
            outcome = "failed as the user's"
        wall = time.monotonic() - start
        assert wall < LOSS_DEADLINE_S, (what, outcome, wall)
        outcomes[outcome] = outcomes.get(outcome, 0) + 1
        print(f"{what}: {outcome} in {wall:.1f} s")
    print(f"hostile losses: {outcomes}")
    sc.close("success")
    _healthy(fuzz_server)


#: a loss the shape check refuses answers in well under a second; one that runs is small
LOSS_DEADLINE_S = 30


def _settles(http: httpx.Client, key: str, request_id: str, what: str) -> None:
    """The future of an accepted hostile body finishes (ok, or failed as the user's fault)."""
    deadline = time.monotonic() + REQUEST_TIMEOUT_S
    while time.monotonic() < deadline:
        r = http.post(
            "/api/v1/retrieve_future",
            json={"request_id": request_id},
            headers={"X-API-Key": key, "Accept": "application/json"},
        )
        assert r.status_code < 500, (what, r.status_code, r.text)
        body = r.json() if r.headers.get("content-type", "").startswith("application/json") else {}
        if body.get("type") != "try_again":
            assert body.get("category", "user") == "user", (what, body)
            return
    raise AssertionError(f"{what}: future {request_id} did not settle in {REQUEST_TIMEOUT_S} s")
