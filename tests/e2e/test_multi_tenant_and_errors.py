"""Two tenants train at once on one base model; bad input fails cleanly and the server keeps
serving."""

from __future__ import annotations

import threading

import httpx
import numpy as np
import pytest
import tinker
from tinker import types
from tinker.proto import tinker_public_pb2 as pb

pytestmark = pytest.mark.e2e
BASE = "twinkle/tiny-chat"


def _data(seed: int) -> list[types.Datum]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(3):
        toks = rng.integers(5, 900, size=10).tolist()
        out.append(
            types.Datum(
                model_input=types.ModelInput.from_ints(toks[:-1]),
                loss_fn_inputs={
                    "target_tokens": toks[1:],
                    "weights": rng.uniform(0.2, 1.5, 9).tolist(),
                },
            )
        )
    return out


def _run(url: str, key: str, data, seed: int, steps: int, out: list) -> None:
    sc = tinker.ServiceClient(base_url=url, api_key=key)
    tc = sc.create_lora_training_client(base_model=BASE, rank=4, seed=seed)
    for _ in range(steps):
        fb = tc.forward_backward(data, "cross_entropy")
        opt = tc.optim_step(types.AdamParams(learning_rate=5e-3, weight_decay=0.01))
        out.append(fb.result().metrics["loss:sum"])
        opt.result()
    sc.close("success")


def test_two_keys_train_concurrently_like_solo(server):
    key_a, key_b = server.create_key("tenant-a"), server.create_key("tenant-b")
    data_a, data_b = _data(1), _data(2)
    steps = 6
    solo_a: list[float] = []
    solo_b: list[float] = []
    _run(server.url, key_a, data_a, 5, steps, solo_a)
    _run(server.url, key_b, data_b, 9, steps, solo_b)

    conc_a: list[float] = []
    conc_b: list[float] = []
    threads = [
        threading.Thread(target=_run, args=(server.url, key_a, data_a, 5, steps, conc_a)),
        threading.Thread(target=_run, args=(server.url, key_b, data_b, 9, steps, conc_b)),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert len(conc_a) == steps and len(conc_b) == steps
    np.testing.assert_allclose(conc_a, solo_a, atol=1e-5, rtol=0)
    np.testing.assert_allclose(conc_b, solo_b, atol=1e-5, rtol=0)
    assert solo_a != solo_b  # different data and seeds: the comparison is not vacuous


@pytest.mark.parametrize(
    "headers",
    [{}, {"X-API-Key": "sk-not-a-tinker-key"}, {"X-API-Key": "tml-" + "x" * 43}],
    ids=["no-key", "no-tml-prefix", "unknown-key"],
)
def test_bad_keys_get_401_json(server, headers):
    r = httpx.post(
        f"{server.url}/api/v1/create_session",
        json={"type": "create_session"},
        headers=headers,
        timeout=10,
    )
    assert r.status_code == 401
    assert r.json()["error"]["code"] == "unauthenticated"


def test_sdk_with_unknown_key_raises_authentication_error(server):
    sc = tinker.ServiceClient(base_url=server.url, api_key="tml-" + "y" * 43)
    with pytest.raises(tinker.AuthenticationError):
        sc.create_lora_training_client(base_model=BASE, rank=4)


def _datum(tokens, targets, weights):
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens),
        loss_fn_inputs={"target_tokens": targets, "weights": weights},
    )


def test_bad_input_fails_future_and_server_keeps_training(server, api_key):
    sc = tinker.ServiceClient(base_url=server.url, api_key=api_key)
    tc = sc.create_lora_training_client(base_model=BASE, rank=4, seed=3)

    with pytest.raises(tinker.RequestFailedError) as exc:
        tc.forward_backward([_datum([1, 2, 5000], [2, 3, 4], [1.0] * 3)], "cross_entropy").result()
    msg = str(exc.value)
    assert "model_input" in msg and "5000" in msg and "vocab" in msg.lower()

    with pytest.raises(tinker.RequestFailedError) as exc:
        tc.forward_backward([_datum([1, 2, 3], [2, 3, 99999], [1.0] * 3)], "cross_entropy").result()
    assert "target_tokens" in str(exc.value)

    with pytest.raises(tinker.RequestFailedError) as exc:
        tc.forward_backward([_datum([1, 2, 3], [2, 3, 4], [1.0, 1.0])], "cross_entropy").result()
    assert "weights" in str(exc.value) and "shape" in str(exc.value)

    # The SDK refuses an empty batch locally; send one raw on another model of the same tenant.
    other = sc.create_lora_training_client(base_model=BASE, rank=4, seed=3)
    body = pb.ForwardBackwardRequest(model_id=other.model_id, seq_id=1, loss_fn="cross_entropy")
    headers = {"X-API-Key": api_key, "Content-Type": "application/x-protobuf"}
    r = httpx.post(
        f"{server.url}/api/v1/forward_backward",
        content=body.SerializeToString(),
        headers=headers,
        timeout=10,
    )
    assert r.status_code == 200, r.text
    res = httpx.post(
        f"{server.url}/api/v1/retrieve_future",
        headers={"X-API-Key": api_key},
        json={"request_id": r.json()["request_id"]},
        timeout=40,
    ).json()
    assert res["category"] == "user" and "data: must contain at least one datum" in res["error"]

    with pytest.raises(tinker.RequestFailedError) as exc:
        tc.forward_backward([_datum([1, 2, 3], [2, 3, 4], [1.0] * 3)], "no_such_loss").result()
    assert "cross_entropy" in str(exc.value)

    # The same model (and the server) keep working after every failure.
    ok = tc.forward_backward([_datum([1, 2, 3], [2, 3, 4], [1.0] * 3)], "cross_entropy")
    step = tc.optim_step(types.AdamParams(learning_rate=1e-3))
    assert ok.result().metrics["loss:sum"] > 0
    assert "grad_norm" in step.result().metrics
    sc.close("success")


def test_unknown_base_model_and_bad_rank_are_400(server, api_key):
    sc = tinker.ServiceClient(base_url=server.url, api_key=api_key)
    with pytest.raises(tinker.BadRequestError, match="not served"):
        sc.create_lora_training_client(base_model="no/such-model", rank=4).result()
    with pytest.raises(tinker.BadRequestError, match="max LoRA rank"):
        sc.create_lora_training_client(base_model=BASE, rank=4096).result()
    sc.close("success")


def test_tenant_cannot_see_other_tenants_models(server):
    key_a, key_b = server.create_key("iso-a"), server.create_key("iso-b")
    sc = tinker.ServiceClient(base_url=server.url, api_key=key_a)
    tc = sc.create_lora_training_client(base_model=BASE, rank=4)
    r = httpx.post(
        f"{server.url}/api/v1/get_info",
        json={"model_id": tc.model_id},
        headers={"X-API-Key": key_b},
        timeout=10,
    )
    assert r.status_code == 404
    r = httpx.get(
        f"{server.url}/api/v1/training_runs/{tc.model_id}", headers={"X-API-Key": key_b}, timeout=10
    )
    assert r.status_code == 404
    sc.close("success")
