"""The attacks of the hostile-tenant e2e (tests/e2e/test_hostile_tenants.py), one function each.

Each takes the `Arena` (the server, the attacker's and an admin's keys, the honest tenants' keys)
and asserts the server refused or contained it: a 4xx naming the rule, a failed future that is the
attacker's own, or a bound that held. The honest tenants' steps, healthz and memory are watched
by the test around every attack, not here.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import httpx
import numpy as np
import tinker
import torch
from tinker import types

from gateway.tinker_api.wire_pb import pb
from tests.factories import empty_sparse, proto_datum

BASE = "twinkle/tiny-chat"
PROTO = "application/x-protobuf"
NATIVE = f"/api/v1/model/{BASE}/twinkle"
LORA4 = json.dumps({"_TWINKLE_TYPE_": "LoraConfig", "r": 4, "target_modules": "all-linear"})


@dataclass
class Arena:
    url: str
    data_dir: str
    attacker: str  # API key; quotas: 2 training clients, 3 checkpoints
    admin: str
    honest: list[str]

    def http(self, timeout: float = 60) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=timeout)


def _raw_model(a: Arena) -> tuple[tinker.ServiceClient, str]:
    """A LoRA model of the attacker's driven by raw protobuf bodies from seq_id 1."""
    service = tinker.ServiceClient(base_url=a.url, api_key=a.attacker)
    tc = service.create_lora_training_client(base_model=BASE, rank=4).result()
    return service, tc.model_id


def sparse_tensors_summed_per_request(a: Arena) -> None:
    """~1 KB bodies whose sparse tensors, each under the per-tensor cap, sum to GiBs once dense:
    read by the loss, a fast 413; under names no loss reads, dropped unread (the step runs)."""
    service, mid = _raw_model(a)
    headers = {"X-API-Key": a.attacker, "Content-Type": PROTO}
    read = pb.ForwardBackwardRequest(model_id=mid, seq_id=1, loss_fn="cross_entropy")
    for _ in range(9):  # 9 x 2**24 float32 cells: 576 MiB dense, ~100 bytes each on the wire
        d = read.data.add()
        d.CopyFrom(proto_datum([1, 2, 3]))
        d.loss_fn_inputs["weights"].CopyFrom(empty_sparse(2**24))
    unread = pb.ForwardBackwardRequest(model_id=mid, seq_id=2, loss_fn="cross_entropy")
    d = unread.data.add()
    d.CopyFrom(proto_datum([1, 2, 3]))
    for k in range(23):  # 23 x 64 MiB under names cross_entropy never reads
        d.loss_fn_inputs[f"junk{k}"].CopyFrom(empty_sparse(2**24))
    with a.http() as http:
        for msg in (read, unread):
            body = msg.SerializeToString()
            assert len(body) < 2048, len(body)
            t0 = time.monotonic()
            r = http.post("/api/v1/forward_backward", content=body, headers=headers)
            assert time.monotonic() - t0 < 10, time.monotonic() - t0
            if msg is read:
                assert r.status_code == 413, r.text
                assert "max_decoded_request_mb" in r.text, r.text
            else:
                assert r.status_code == 200, r.text
    service.close("success").result()


def native_loads_past_the_training_client_cap(a: Arena) -> None:
    """Native loads into new adapter names take training-client slots: past the attacker's cap of
    2, a 403 naming max_training_clients, and no run is left behind."""
    with a.http() as http:
        h = {"Authorization": f"Bearer {a.attacker}"}
        r = http.post("/api/v1/twinkle/create_session", json={}, headers=h)
        assert r.status_code == 200, r.text
        h["X-Twinkle-Session-Id"] = r.json()["session_id"]

        def call(method: str, body: dict) -> httpx.Response:
            return http.post(f"{NATIVE}/{method}", json=body, headers=h)

        assert call("create", {}).status_code == 200
        r = call("add_adapter_to_model", {"adapter_name": "a", "config": LORA4})
        assert r.status_code == 200, r.text
        r = call("save", {"name": "hostile-load", "adapter_name": "a"})
        assert r.status_code == 200, r.text
        path = r.json()["twinkle_path"]
        codes = [
            call(m, {"name": path, "adapter_name": f"x{i}"}).status_code
            for i, m in enumerate(["load", "resume_from_checkpoint"] * 3)
        ]
        assert codes[0] == 200 and set(codes[1:]) == {403}, codes
        runs = http.get("/api/v1/twinkle/training_runs", headers=h).json()["training_runs"]
        mine = [r["training_run_id"] for r in runs]
        mine = [r for r in mine if r.startswith(h["X-Twinkle-Session-Id"] + ":")]
        assert len(mine) == 2, mine  # "a" and x0: the refused loads left no run behind


def _attacker_adapters(a: Arena, model_ids: set[str]) -> set[str]:
    with a.http() as http:
        r = http.get("/api/v1/admin/engine", headers={"X-API-Key": a.admin})
    assert r.status_code == 200, r.text
    held = {x["model_id"] for x in r.json()["models"][BASE]["trainer"]["adapters"]}
    return held & model_ids


def finished_sessions_release_their_adapters(a: Arena) -> None:
    """Sessions opened and finished in a loop (each with two models, the cap) leave the Trainer
    holding none of their adapters."""
    made: set[str] = set()
    for _ in range(3):
        service = tinker.ServiceClient(base_url=a.url, api_key=a.attacker)
        for _ in range(2):
            tc = service.create_lora_training_client(base_model=BASE, rank=4).result()
            made.add(tc.model_id)
        service.close("success").result()
    deadline = time.monotonic() + 30
    while (held := _attacker_adapters(a, made)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not held, f"finished sessions' adapters still loaded: {held}"


def ephemeral_sampler_saves_are_bounded(a: Arena) -> None:
    """Unnamed sampler saves past ``gateway.max_ephemeral_saves`` (8) replace the oldest: the
    first one's sampling client is gone (404), the newest samples."""
    service = tinker.ServiceClient(base_url=a.url, api_key=a.attacker)
    tc = service.create_lora_training_client(base_model=BASE, rank=4).result()
    samplers = [tc.save_weights_and_get_sampling_client().result() for _ in range(10)]
    params = types.SamplingParams(max_tokens=2, temperature=0.0)
    prompt = types.ModelInput.from_ints([5, 6, 7])
    newest = samplers[-1].sample(prompt=prompt, num_samples=1, sampling_params=params).result()
    assert newest.sequences
    try:
        samplers[0].sample(prompt=prompt, num_samples=1, sampling_params=params).result()
    except Exception as exc:  # the SDK raises its NotFoundError (404) here
        assert "404" in str(exc) or "not found" in str(exc).lower(), exc
    else:
        raise AssertionError("the oldest of 10 ephemeral saves still samples")
    service.close("success").result()


def a_jwt_cannot_mint_its_successor(a: Arena) -> None:
    with a.http() as http:
        r = http.post("/api/v1/auth/token", headers={"X-API-Key": a.attacker})
        assert r.status_code == 200, r.text
        jwt = r.json()["jwt"]
        for headers in ({"Authorization": f"Bearer {jwt}"}, {"X-API-Key": jwt}):
            r = http.post("/api/v1/auth/token", headers=headers)
            assert r.status_code in (401, 403), (headers.keys(), r.status_code, r.text)


def unauthenticated_idempotent_bodies_are_not_buffered(a: Arena) -> None:
    """Eight concurrent 48 MiB bodies with X-Idempotency-Key and a wrong key: each a quick 401."""
    chunk = b"\0" * 2**20
    codes: list[int] = []
    walls: list[float] = []

    def send(i: int) -> None:
        t0 = time.monotonic()
        try:
            with a.http(timeout=120) as http:
                r = http.post(
                    "/api/v1/forward_backward",
                    content=(chunk for _ in range(48)),
                    headers={
                        "X-API-Key": "tml-not-a-key",
                        "X-Idempotency-Key": f"flood-{i}",
                        "Content-Type": PROTO,
                    },
                )
                codes.append(r.status_code)
        except httpx.HTTPError:  # the server answered 401 and closed while we still sent
            codes.append(401)
        walls.append(time.monotonic() - t0)

    threads = [threading.Thread(target=send, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    assert codes and set(codes) <= {401, 413}, codes
    assert max(walls) < 30, walls


def unauthenticated_requests_store_bounded_audit_rows(a: Arena) -> None:
    """A flood of denied requests with 32 KiB paths: the audit rows it leaves are few and small."""
    long = "/api/v1/training_runs/" + "x" * 32_000
    with a.http() as http:
        for _ in range(100):
            http.get(long, headers={"X-API-Key": "tml-not-a-key"})
        r = http.get(
            "/api/v1/admin/audit",
            params={"event": "access_denied", "newest_first": True, "limit": 1000},
            headers={"X-API-Key": a.admin},
        )
    assert r.status_code == 200, r.text
    rows = r.json()["entries"]
    assert len(json.dumps(rows)) < 100 * 4096, "each denied request stored its whole path"


def errors_name_no_server_path(a: Arena) -> None:
    """A load of a checkpoint that is not there fails without the server's storage path."""
    service = tinker.ServiceClient(base_url=a.url, api_key=a.attacker)
    tc = service.create_lora_training_client(base_model=BASE, rank=4).result()
    path = tc.save_state("hostile-path").result().path
    try:
        tc.load_state(path.replace("hostile-path", "no-such-checkpoint")).result()
    except Exception as exc:
        text = str(exc)
    else:
        raise AssertionError("a missing checkpoint loaded")
    assert a.data_dir not in text and not re.search(r"/(tmp|root|home|var)/", text), text
    service.close("success").result()


def hostile_names_and_fanout(a: Arena) -> None:
    """A checkpoint name ending in a newline is a 400; one native sample request of 256 inputs x
    64 samples is a 413; /v1/models names no other user."""
    service = tinker.ServiceClient(base_url=a.url, api_key=a.attacker)
    tc = service.create_lora_training_client(base_model=BASE, rank=4).result()
    try:
        tc.save_state("ok-name\n").result()
    except Exception as exc:
        assert "400" in str(exc) or "name" in str(exc).lower(), exc
    else:
        raise AssertionError("a name ending in a newline was accepted")
    service.close("success").result()
    body = {
        "inputs": [{"input_ids": [1, 2, 3]}] * 256,
        "sampling_params": {"max_tokens": 4, "num_samples": 64},
    }
    with a.http() as http:
        h = {"Authorization": f"Bearer {a.attacker}"}
        r = http.post("/api/v1/twinkle/create_session", json={}, headers=h)
        assert r.status_code == 200, r.text
        h["X-Twinkle-Session-Id"] = r.json()["session_id"]
        r = http.post(f"/api/v1/sampler/{BASE}/twinkle/sample", json=body, headers=h)
        assert r.status_code == 413, r.text
        models = http.get("/v1/models", headers=h)
    assert models.status_code == 200, models.text
    for name in ("honest-0", "honest-1"):
        assert name not in models.text, models.text


def unpublished_weights_stop_sampling(a: Arena) -> None:
    """The attacker samples an honest tenant's published sampler weights; once the owner
    unpublishes them, the attacker's existing sampling client is refused."""
    owner = tinker.ServiceClient(base_url=a.url, api_key=a.honest[0])
    tc = owner.create_lora_training_client(base_model=BASE, rank=4).result()
    path = tc.save_weights_for_sampler("shared").result().path
    rest = owner.create_rest_client()
    rest.publish_checkpoint_from_tinker_path(path).result()
    reader = tinker.ServiceClient(base_url=a.url, api_key=a.attacker)
    sampler = reader.create_sampling_client(model_path=path, base_model=BASE).result()
    params = types.SamplingParams(max_tokens=2, temperature=0.0)
    prompt = types.ModelInput.from_ints([5, 6, 7])
    assert sampler.sample(prompt=prompt, num_samples=1, sampling_params=params).result().sequences
    rest.unpublish_checkpoint_from_tinker_path(path).result()
    try:
        sampler.sample(prompt=prompt, num_samples=1, sampling_params=params).result()
    except Exception as exc:
        assert "404" in str(exc) or "not found" in str(exc).lower(), exc
    else:
        raise AssertionError("unpublished weights still sample for another user")
    reader.close("success").result()
    owner.close("success").result()


def _kk_index_select(logprobs, x):
    """[1, K] rows picked by K indices: K x K elements from a K-element input."""
    return torch.index_select(x.reshape(1, -1), 0, x.long()).sum(), {}


def _nuclear_norm(logprobs, x):
    """An SVD of x's outer product: ~m n min(m, n) work for a 1-token datum."""
    return torch.norm(x.reshape(-1, 1) * x.reshape(1, -1), p="nuc"), {}


def _chain(logprobs, x):
    """Forty chained copies of an outer product, each kept for backward."""
    o = x.reshape(-1, 1) * x.reshape(1, -1)
    for _ in range(40):
        o = o * 1.0001
    return o.sum(), {}


def _poison(logprobs, x):
    """Fine on zeros (what a shape check sees), out of range on real log-probs."""
    return logprobs[(-1000 * logprobs).long()].sum() + 0 * x.sum(), {}


def _custom_datum(x: np.ndarray) -> types.Datum:
    return types.Datum(
        model_input=types.ModelInput.from_ints([5, 6, 7]),
        loss_fn_inputs={"target_tokens": [6, 7, 8], "x": types.TensorData.from_numpy(x)},
    )


def custom_losses_built_to_allocate_or_spin(a: Arena) -> None:
    """Each is refused by the shape check in seconds, naming its node, before it allocates."""
    service = tinker.ServiceClient(base_url=a.url, api_key=a.attacker)
    tc = service.create_lora_training_client(base_model=BASE, rank=4).result()
    cases = [
        (_kk_index_select, np.zeros(16384, np.float32)),  # 1 GiB of float32 once selected
        (_nuclear_norm, np.ones(2048, np.float32)),  # ~16 s of one core unchecked
        (_chain, np.ones(4096, np.float32)),  # 40 x 64 MiB
    ]
    for fn, x in cases:
        handle = service.create_custom_loss(fn, {"logprobs": 1, "x": 1}).result()
        t0 = time.monotonic()
        try:
            tc.forward_backward_custom([_custom_datum(x)], handle).result()
        except Exception as exc:
            assert "node" in str(exc), (fn.__name__, exc)
        else:
            raise AssertionError(f"{fn.__name__} ran")
        assert time.monotonic() - t0 < 30, (fn.__name__, time.monotonic() - t0)
    service.close("success").result()


def a_failing_loss_in_a_fused_pass_stays_its_own(a: Arena) -> None:
    """A loss that passes the shape check and fails on real values, sent while the honest
    tenants train (so it is fused with their steps): the attacker gets its own error each time;
    the honest steps, watched by the test, all succeed."""
    service = tinker.ServiceClient(base_url=a.url, api_key=a.attacker)
    tc = service.create_lora_training_client(base_model=BASE, rank=4).result()
    handle = service.create_custom_loss(_poison, {"logprobs": 1, "x": 1}).result()
    for _ in range(4):
        try:
            tc.forward_backward_custom([_custom_datum(np.zeros(3, np.float32))], handle).result()
        except Exception as exc:
            assert "index" in str(exc).lower() or "node" in str(exc), exc
        else:
            raise AssertionError("an out-of-range index on real values succeeded")
    service.close("success").result()


ATTACKS: list[Callable[[Arena], None]] = [
    sparse_tensors_summed_per_request,
    custom_losses_built_to_allocate_or_spin,
    a_failing_loss_in_a_fused_pass_stays_its_own,
    finished_sessions_release_their_adapters,
    ephemeral_sampler_saves_are_bounded,
    a_jwt_cannot_mint_its_successor,
    unauthenticated_idempotent_bodies_are_not_buffered,
    unauthenticated_requests_store_bounded_audit_rows,
    errors_name_no_server_path,
    hostile_names_and_fanout,
    unpublished_weights_stop_sampling,
    # last: a native session has no close, so its two slots stay taken until it expires
    native_loads_past_the_training_client_cap,
]
