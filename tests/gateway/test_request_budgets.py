"""Per-request and per-user budgets on what a request makes the gateway hold, on the real app
(real SQLite, the mock engine: these are about the gateway's memory, not training numbers):

* a forward_backward is sized before anything in it is expanded: sparse tensors at their dense
  shape, summed over the whole request (``gateway.max_decoded_request_mb``), a 413 naming the
  field and the limit, and the seq_id still passes in order;
* ``loss_fn_inputs`` no loss reads are dropped unread (so a ~1 KB body cannot decode to GiBs);
* a zstd body is inflated to at most ``gateway.max_request_body_mb``; a JSON body is sized
  before it is parsed;
* what one user's unfinished sequenced requests hold (behind a seq_id gap) is bounded per user,
  in bytes and in count (429 + retry-after), and the request its model runs next is always let
  through, so the gap can close;
* sampling requests are bounded per request in sequences and tokens, in all three dialects.
"""

from __future__ import annotations

import json
import time
import tracemalloc

import pytest
import zstandard
from tinker import types

from gateway.tinker_api.wire_pb import pb
from tests.factories import empty_sparse, proto_datum
from tests.gateway.harness import BASE, fwdbwd, fwdbwd_body, model

ENGINE_BACKEND = "mock"  # HTTP semantics and gateway memory only (tests/gateway/conftest.py)
PROTO = "application/x-protobuf"
S = f"/api/v1/sampler/{BASE}/twinkle"


@pytest.fixture(scope="module")
def gw(make_gateway):
    return make_gateway(
        gateway={
            "max_request_body_mb": 4,
            "max_decoded_request_mb": 24,
            "max_held_mb_per_user": 1,
            "max_pending_sequenced_per_user": 3,
            "max_sequences_per_sample_request": 8,
            "max_sample_tokens_per_request": 1000,
        }
    )


def _post(gw, key: str, body: bytes, **headers):
    return gw.client.post(
        "/api/v1/forward_backward",
        content=body,
        headers={"X-API-Key": key, "Content-Type": PROTO, **headers},
    )


def _traced(fn):
    """(fn's result, the peak bytes Python and numpy allocated while it ran)."""
    tracemalloc.start()
    try:
        out = fn()
        return out, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def _ok(gw, key: str, r) -> None:
    assert r.status_code == 200, r.text
    done = gw.wait(r.json(), key)
    assert not isinstance(done, dict) or "error" not in done, done


def test_unread_sparse_inputs_of_a_tiny_body_are_never_expanded(gw) -> None:
    key = gw.key("unread")
    mid = model(gw.client, key)
    msg = pb.ForwardBackwardRequest(model_id=mid, seq_id=1, loss_fn="cross_entropy")
    d = msg.data.add()
    d.CopyFrom(proto_datum([1, 2, 3]))
    for k in range(4):  # 4 x 2**24 int64 cells: 512 MiB once dense, ~40 bytes each on the wire
        d.loss_fn_inputs[f"junk{k}"].CopyFrom(empty_sparse(2**24, pb.DTYPE_INT64))
    body = msg.SerializeToString()
    assert len(body) < 400
    r, peak = _traced(lambda: _post(gw, key, body))
    _ok(gw, key, r)  # no loss reads them: dropped unread, the step runs
    assert peak < 16 * 2**20, f"{peak / 2**20:.0f} MiB allocated for a {len(body)}-byte body"


def test_sparse_tensors_are_summed_per_request_before_expanding(gw) -> None:
    key = gw.key("summed")
    mid = model(gw.client, key)
    msg = pb.ForwardBackwardRequest(model_id=mid, seq_id=1, loss_fn="cross_entropy")
    for _ in range(4):  # each 16 MiB of float32 (under the 24 MiB budget alone): 64 MiB in all
        d = msg.data.add()
        d.CopyFrom(proto_datum([1, 2, 3]))
        d.loss_fn_inputs["weights"].CopyFrom(empty_sparse(2**22))
    body = msg.SerializeToString()
    t0 = time.monotonic()
    r, peak = _traced(lambda: _post(gw, key, body))
    assert r.status_code == 413, r.text
    message = r.json()["error"]["message"]
    assert "gateway.max_decoded_request_mb" in message and "64.0 MiB" in message, message
    assert message.startswith("data[0].loss_fn_inputs.weights"), message
    assert time.monotonic() - t0 < 5 and peak < 8 * 2**20, peak
    _ok(gw, key, fwdbwd(gw.client, key, mid, 2))  # seq_id 1 passed in order: 2 runs at once


def test_a_zstd_body_inflates_no_further_than_the_body_cap(gw) -> None:
    key = gw.key("zstd")
    bomb = zstandard.ZstdCompressor().compress(b"\0" * (64 * 2**20))  # ~2 KB, 64 MiB inflated
    assert len(bomb) < 64 * 1024
    r, peak = _traced(lambda: _post(gw, key, bomb, **{"Content-Encoding": "zstd"}))
    assert r.status_code == 413, r.text
    assert "gateway.max_request_body_mb" in r.json()["error"]["message"]
    assert peak < 16 * 2**20, f"{peak / 2**20:.0f} MiB allocated inflating a {len(bomb)}-byte body"


def test_a_json_body_is_sized_before_it_is_parsed(gw) -> None:
    key = gw.key("json")
    mid = model(gw.client, key)
    values = 2**20  # 2 MB of "0," is a million Python objects (~32 MiB) once parsed
    datum = {
        "model_input": {"chunks": [{"tokens": [1]}]},
        "loss_fn_inputs": {"weights": {"dtype": "float32", "data": [0] * values}},
    }
    payload = {
        "model_id": mid,
        "seq_id": 1,
        "forward_backward_input": {"loss_fn": "cross_entropy", "data": [datum]},
    }
    r = gw.client.post(
        "/api/v1/forward_backward",
        content=json.dumps(payload, separators=(",", ":")).encode(),
        headers={"X-API-Key": key, "Content-Type": "application/json"},
    )
    assert r.status_code == 413, r.text
    assert "gateway.max_decoded_request_mb" in r.json()["error"]["message"]


def _big_step(mid: str, seq_id: int) -> bytes:
    """~0.6 MiB once decoded: 16 datums of 2,000 tokens (token, int64 target, float32 weight)."""
    toks = [(i % 50) + 1 for i in range(2000)]
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(toks),
        loss_fn_inputs={"target_tokens": toks, "weights": [1.0] * len(toks)},
    )
    return fwdbwd_body(mid, seq_id, [datum] * 16)


def test_input_held_behind_a_seq_gap_is_bounded_per_user(gw) -> None:
    key, other = gw.key("gap-bytes"), gw.key("gap-bystander")
    mid, theirs = model(gw.client, key), model(gw.client, other)
    held = _post(gw, key, _big_step(mid, 3))  # waits for seq_ids 1 and 2
    assert held.status_code == 200, held.text
    r = _post(gw, key, _big_step(mid, 4))
    assert r.status_code == 429, r.text
    assert "gateway.max_held_mb_per_user" in r.json()["error"]["message"]
    assert int(r.headers["retry-after"]) >= 1
    _ok(gw, other, fwdbwd(gw.client, other, theirs, 1))  # another user is not affected
    _ok(gw, key, _post(gw, key, _big_step(mid, 1)))  # the model's next: admitted over the limit
    _ok(gw, key, fwdbwd(gw.client, key, mid, 2))  # the gap closes
    _ok(gw, key, held)
    _ok(gw, key, _post(gw, key, _big_step(mid, 4)))  # the retry fits now


def test_requests_held_behind_a_seq_gap_are_counted_per_user(gw) -> None:
    key = gw.key("gap-count")
    mid = model(gw.client, key)
    parked = [fwdbwd(gw.client, key, mid, s) for s in (3, 4, 5)]
    assert all(r.status_code == 200 for r in parked), [r.text for r in parked]
    r = gw.client.post(
        "/api/v1/optim_step",
        json={"model_id": mid, "seq_id": 6, "adam_params": {"learning_rate": 1e-4}},
        headers={"X-API-Key": key},
    )
    assert r.status_code == 429, r.text
    assert "gateway.max_pending_sequenced_per_user" in r.json()["error"]["message"]
    for s in (1, 2):
        _ok(gw, key, fwdbwd(gw.client, key, mid, s))
    for r in parked:
        _ok(gw, key, r)


# -- sampling: sequences and tokens per request, every dialect -------------------------------------


def test_sampling_requests_are_bounded_in_sequences_and_tokens(gw) -> None:
    key = gw.key("sampler")
    h = {"X-API-Key": key}
    prompt = {"chunks": [{"type": "encoded_text", "tokens": [1, 2, 3]}]}
    tinker = {"base_model": BASE, "prompt": prompt, "sampling_params": {"max_tokens": 4}}
    r = gw.client.post("/api/v1/asample", json={**tinker, "num_samples": 9}, headers=h)
    assert r.status_code == 413 and "num_samples: 9 sequences" in r.text, r.text
    long = {**tinker, "num_samples": 2, "sampling_params": {"max_tokens": 600}}
    r = gw.client.post("/api/v1/asample", json=long, headers=h)
    assert r.status_code == 413 and "gateway.max_sample_tokens_per_request" in r.text, r.text
    r = gw.client.post("/api/v1/asample", json={**tinker, "num_samples": 8}, headers=h)
    assert r.status_code == 200, r.text
    assert gw.wait(r.json(), key).status_code == 200

    body = {"model": BASE, "prompt": ["a", "b", "c"], "n": 3, "max_tokens": 2}
    r = gw.client.post("/v1/completions", json=body, headers=h)
    assert r.status_code == 413 and "gateway.max_sequences_per_sample_request" in r.text, r.text

    sess = gw.client.post("/api/v1/twinkle/create_session", json={}, headers=h).json()
    nh = {**h, "X-Twinkle-Session-Id": sess["session_id"]}
    rows = [{"input_ids": [1, 2, 3]}] * 256
    native = {"inputs": rows, "num_samples": 64, "sampling_params": {"max_tokens": 8}}
    r = gw.client.post(f"{S}/sample", json=native, headers=nh)
    assert r.status_code == 413 and "inputs x num_samples: 16384 sequences" in r.text, r.text
    ok = {"inputs": rows[:2], "num_samples": 4, "sampling_params": {"max_tokens": 8}}
    r = gw.client.post(f"{S}/sample", json=ok, headers=nh)
    assert r.status_code == 200, r.text


# -- X-Idempotency-Key: bodies buffered linearly, and only for a valid key past 1 MiB --------------


def _asgi_post(gw, path: str, headers: dict, chunks: int, chunk: bytes) -> tuple[int, int, float]:
    """POST ``chunks`` x ``chunk`` to the app as an ASGI server does (one message per chunk):
    (status, messages the app read, seconds)."""
    read = 0
    status: list[int] = []

    async def receive():
        nonlocal read
        if read >= chunks:
            return {"type": "http.disconnect"}
        read += 1
        return {"type": "http.request", "body": chunk, "more_body": read < chunks}

    async def send(message):
        if message["type"] == "http.response.start":
            status.append(message["status"])

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [(k.lower().encode(), v.encode()) for k, v in headers.items()],
        "client": ("127.0.0.1", 1234),
        "server": ("testserver", 80),
    }
    t0 = time.monotonic()
    gw.client.portal.call(gw.app, scope, receive, send)
    return status[0], read, time.monotonic() - t0


def test_idempotent_bodies_are_buffered_only_for_valid_keys_and_linearly(gw) -> None:
    chunk, n = b"\0" * 512, 8192  # 4 MiB (the body cap here) in 512-byte messages
    base = {"content-type": PROTO, "x-idempotency-key": "k1", "content-length": str(n * 512)}
    bad = {**base, "x-api-key": "tml-not-a-key"}
    status, read, _ = _asgi_post(gw, "/api/v1/forward_backward", bad, n, chunk)
    assert status == 401 and read == 0, (status, read)  # nothing buffered before the 401
    good = {**base, "x-api-key": gw.key("idem"), "x-idempotency-key": "k2"}
    status, read, secs = _asgi_post(gw, "/api/v1/forward_backward", good, n, chunk)
    assert status == 400 and read == n, (status, read)  # read whole; not a protobuf message
    # appending each message to the body so far copied 16 GiB here (1.3 s); joined once: 0.02 s
    assert secs < 0.5, secs
