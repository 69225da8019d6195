"""Every dialect writes the same usage-ledger rows for the same operations.

The real gateway app served over HTTP by uvicorn in this process (in-process engine on the tiny
model, real SQLite), driven by each client a user may bring: the Tinker SDK (0.38), our native
client (`twinkle_client`), upstream's native client (twinkle-kit 0.5.1, in its compat venv:
tests/compat/venv.py) and the OpenAI API (sampling a checkpoint that the Tinker SDK trained and
saved). Each user creates a run, trains one batch, saves one checkpoint and samples once; the
ledger must then hold, for that user: the trained tokens, one checkpoint, prefill and sampled
tokens, each row under the user's one session and the base model.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
import tinker
import uvicorn
from sqlmodel import Session, select
from tinker import types

import twinkle_client
from engine.base_models.registry import resolve_model_dir
from gateway.db import make_engine
from gateway.db.tables import SessionRow, UsageBucketRow, UserRow
from tests.gateway.harness import BASE, build_engines, make_app, new_key, sqlite_url
from tests.services import free_port
from tests.twinkle_scripts import _setup, hf_data, roll
from twinkle_client.model import MultiLoraTransformersModel as RemoteModel
from twinkle_client.sampler import vLLMSampler

METERED = {"training", "checkpoint", "sampling_prefill", "sampling_sample"}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    data = Path(tmp_path_factory.mktemp("ledger"))
    db_url = sqlite_url(data)
    app = make_app(data, db_url, build_engines(data, 1)[0])
    port = free_port()
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not srv.started and time.monotonic() < deadline:
        time.sleep(0.1)
    assert srv.started
    yield {"url": f"http://127.0.0.1:{port}", "db_url": db_url, "data": data}
    srv.should_exit = True
    thread.join(30)


def _tinker_train_and_save(
    url: str, key: str, sampler_save: bool
) -> tuple[tinker.TrainingClient, str]:
    """A new run that trains 5 tokens and saves one checkpoint; the client and that path."""
    sc = tinker.ServiceClient(base_url=url, api_key=key)
    tc = sc.create_lora_training_client(base_model=BASE, rank=4)
    datum = types.Datum(
        model_input=types.ModelInput.from_ints([1, 2, 3, 4, 5]),
        loss_fn_inputs={"target_tokens": [2, 3, 4, 5, 6], "weights": [1.0] * 5},
    )
    tc.forward_backward([datum], "cross_entropy").result()
    if sampler_save:
        return tc, tc.save_weights_for_sampler("ledger").result().path
    return tc, tc.save_state("ledger").result().path


def _tinker(server, key: str) -> int:
    tc, _ = _tinker_train_and_save(server["url"], key, sampler_save=False)
    sampler = tc.save_weights_and_get_sampling_client()  # an ephemeral save: not metered
    params = types.SamplingParams(max_tokens=3, temperature=0.0)
    sampler.sample(types.ModelInput.from_ints([1, 2, 3]), 1, params).result()
    return 5


def _native_ours(server, key: str) -> int:
    c = twinkle_client.TwinkleClient(server["url"], key, session_heartbeat_interval=None)
    rows = roll(hf_data(resolve_model_dir(BASE, server["data"])))[:1]
    model = RemoteModel(BASE, client=c)
    _setup(model)
    model.forward_backward(inputs=rows)
    model.save("ledger", save_optimizer=False)
    sampler = vLLMSampler(BASE, client=c)
    sampler.set_template("Qwen3_5Template", model_id=BASE, max_length=64)
    traj = {"messages": [{"role": "user", "content": "Name a colour."}]}
    sampler.sample(inputs=[traj], sampling_params={"max_tokens": 3, "temperature": 0.0})
    return len(rows[0]["input_ids"])


def _native_upstream(server, key: str) -> int:
    from tests.compat.run_upstream import run_flow
    from tests.compat.venv import CompatVenvUnavailable, compat_python

    try:
        python = str(compat_python())
    except CompatVenvUnavailable as exc:
        pytest.skip(str(exc))
    return int(run_flow(python, server["url"], key, "ledger")["tokens"])


def _openai(server, key: str) -> int:
    _, path = _tinker_train_and_save(server["url"], key, sampler_save=True)
    r = httpx.post(
        f"{server['url']}/v1/completions",
        json={"model": path, "prompt": "The cat", "max_tokens": 3, "temperature": 0.0},
        headers={"Authorization": f"Bearer {key}"},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    return 5


DIALECTS: dict[str, Callable[[dict, str], int]] = {
    "tinker-sdk": _tinker,
    "native-ours": _native_ours,
    "native-upstream": _native_upstream,
    "openai": _openai,
}


def _ledger(db_url: str, user: str) -> tuple[list[str], list[UsageBucketRow]]:
    """The user's session ids and usage rows (of the metered kinds)."""
    engine = make_engine(db_url)
    try:
        with Session(engine) as db:
            uid = db.exec(select(UserRow.id).where(UserRow.name == user)).one()
            sessions = db.exec(select(SessionRow.id).where(SessionRow.user_id == uid)).all()
            rows = db.exec(select(UsageBucketRow).where(UsageBucketRow.user_id == uid)).all()
            return list(sessions), [r for r in rows if r.kind in METERED]
    finally:
        engine.dispose()


@pytest.mark.parametrize("dialect", list(DIALECTS))
def test_each_dialect_records_the_same_ledger_rows(server, dialect) -> None:
    user = f"ledger-{dialect}"
    trained = DIALECTS[dialect](server, new_key(server["db_url"], user, org="ledger"))
    sessions, rows = _ledger(server["db_url"], user)
    assert len(sessions) == 1, sessions  # every operation ran in the client's one session
    totals = {kind: sum(r.quantity for r in rows if r.kind == kind) for kind in METERED}
    assert totals["training"] == trained
    assert totals["checkpoint"] == 1
    assert totals["sampling_prefill"] > 0 and totals["sampling_sample"] > 0
    unattributed = sorted({(r.kind, r.session_id) for r in rows if r.session_id != sessions[0]})
    assert not unattributed, f"rows without the user's session: {unattributed}"
    assert {r.base_model for r in rows} == {BASE}
