"""Seeds on every API: any signed 64-bit integer works end to end (stored, used), a larger one is
a 400 naming the field. A Tinker ``LoraConfig(seed=2**40)`` is common (a millisecond timestamp is
past 2**31) and needs a 64-bit column on Postgres ('integer out of range' otherwise); 2**70 fits
no database column, so it must be refused on the wire."""

from __future__ import annotations

import pytest
from sqlmodel import Session

from engine.errors import UserInputError
from engine.rules import lora_spec_from_config
from gateway.db import make_engine
from gateway.db.tables import TrainingRunRow
from tests.gateway.harness import BASE, _headers, session, wait_future

TOO_BIG = [2**63, -(2**63) - 1, 2**70]


@pytest.fixture(scope="module", params=["sqlite", "postgres"])
def gw(request, make_gateway):
    with make_gateway(db=request.param) as gw:
        yield gw


def _create(gw, seed: int):
    c, key = gw.client, gw.key("seeder")
    body = {
        "session_id": session(c, key),
        "model_seq_id": 0,
        "base_model": BASE,
        "lora_config": {"rank": 4, "seed": seed},
    }
    return c.post("/api/v1/create_model", headers=_headers(key), json=body), key


@pytest.mark.parametrize("seed", [2**40, 2**63 - 1, -(2**63)])
def test_a_64_bit_lora_seed_is_stored_and_used(gw, seed) -> None:
    r, key = _create(gw, seed)
    assert r.status_code == 200, r.text
    model_id = wait_future(gw.client, key, r.json())["model_id"]
    engine = make_engine(gw.db_url)
    try:
        with Session(engine) as db:
            row = db.get(TrainingRunRow, model_id)
            assert row is not None and row.seed == seed
    finally:
        engine.dispose()


@pytest.mark.parametrize("seed", TOO_BIG)
def test_a_lora_seed_beyond_64_bits_is_a_400(gw, seed) -> None:
    r, _ = _create(gw, seed)
    assert r.status_code == 400, r.text
    assert "lora_config.seed" in r.json()["detail"], r.text
    assert gw.client.get("/api/v1/healthz").status_code == 200


@pytest.mark.parametrize("seed", TOO_BIG)
def test_a_sampling_seed_beyond_64_bits_is_a_400_on_tinker_and_openai(gw, seed) -> None:
    h = {"X-API-Key": gw.key("seeder")}
    r = gw.client.post(
        "/api/v1/asample",
        headers=h,
        json={
            "base_model": BASE,
            "num_samples": 1,
            "prompt": {"chunks": [{"type": "encoded_text", "tokens": [5, 6, 7]}]},
            "sampling_params": {"max_tokens": 2, "seed": seed},
        },
    )
    assert r.status_code == 400 and "sampling_params.seed" in r.json()["detail"], r.text
    r = gw.client.post(
        "/v1/completions",
        headers={"Authorization": f"Bearer {gw.key('seeder')}"},
        json={"model": BASE, "prompt": "hi", "max_tokens": 2, "seed": seed},
    )
    assert r.status_code == 400 and "seed" in r.text, r.text


@pytest.mark.parametrize("seed", [*TOO_BIG, float("inf"), float("nan")])
def test_native_lora_configs_refuse_seeds_beyond_64_bits(seed) -> None:
    """The native client's add_adapter config (a free-form dict) is checked by the engine."""
    with pytest.raises(UserInputError, match="seed"):
        lora_spec_from_config({"r": 4, "seed": seed})
    assert lora_spec_from_config({"r": 4, "seed": 2**63 - 1}).seed == 2**63 - 1
