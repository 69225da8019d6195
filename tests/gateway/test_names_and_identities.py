"""Names are validated whole and listings name no other tenant, through the real gateway app (real
SQLite): a checkpoint name ending in a newline fails its save naming the field (a regex's ``$``
matches before a final newline), and another user's published checkpoint or run shows its
weights but not its owner, on the OpenAI and the Tinker routes."""

from __future__ import annotations

import pytest

from tests.gateway.tinker_rest import model, result, save, tinker_env

ENGINE_BACKEND = "mock"  # HTTP semantics only (tests/gateway/conftest.py)


@pytest.fixture(scope="module")
def env(make_gateway):
    return tinker_env(make_gateway)


@pytest.mark.parametrize("route", ["save_weights", "save_weights_for_sampler"])
@pytest.mark.parametrize("name", ["ck\n", "ck\r\n", "\nck", "ck\x00"])
def test_a_checkpoint_name_with_a_line_break_is_refused(env, route: str, name: str) -> None:
    client, _, _ = env
    model_id = model(client)
    r = client.post(f"/api/v1/{route}", json={"model_id": model_id, "seq_id": 1, "path": name})
    assert r.status_code == 200, r.text  # sequenced: refused in its seq_id order, as a future
    out = result(client, r.json())
    assert out["category"] == "user" and out["error"].startswith("path: checkpoint name"), out


def test_published_checkpoints_do_not_name_their_owner(env) -> None:
    client, _, bob = env
    model_id = model(client)
    path = save(client, model_id, 1, "save_weights_for_sampler", "shared")
    run, ckpt = path[len("tinker://") :].split("/", 1)
    r = client.post(f"/api/v1/training_runs/{run}/checkpoints/{ckpt}/publish")
    assert r.status_code in (200, 204), r.text
    as_bob = {"X-API-Key": bob}

    # OpenAI: the list and the card
    cards = client.get("/v1/models", headers=as_bob).json()["data"]
    (card,) = [c for c in cards if c["id"] == path]
    assert card["owned_by"] == "published"
    one = client.get(f"/v1/models/{path}", headers=as_bob)
    assert one.status_code == 200 and one.json()["owned_by"] == "published"
    # Tinker: the run, listed and by id
    runs = client.get(
        "/api/v1/training_runs", params={"access_scope": "accessible"}, headers=as_bob
    ).json()["training_runs"]
    (listed,) = [x for x in runs if x["training_run_id"] == run]
    got = client.get(
        f"/api/v1/training_runs/{run}", params={"access_scope": "accessible"}, headers=as_bob
    ).json()
    assert listed["model_owner"] == got["model_owner"] == "published"
    for text in (str(cards), one.text, str(runs), str(got)):
        assert "alice" not in text

    # the owner still sees their own name
    mine = client.get("/v1/models").json()["data"]
    assert next(c for c in mine if c["id"] == path)["owned_by"] == "alice"
    assert client.get(f"/v1/models/{path}").json()["owned_by"] == "alice"
    assert client.get(f"/api/v1/training_runs/{run}").json()["model_owner"] == "alice"
