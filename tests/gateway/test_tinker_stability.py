"""Stability info and provenance through the gateway (real app, SQLite, in-process Transformers
engine on the tiny model): a sampling client with ``record_stability_info`` has each returned
sequence recorded under its ``sequence_id`` (the server's own logprobs); ``stable_reinforce``
requests name those sequences in provenance spans, checked before compute (each refusal names
the datum and span, and the model's next request still runs), and train on the recorded
logprobs; records are capped per session (oldest evicted), expire, and go with their session."""

from __future__ import annotations

import math
from datetime import timedelta

import numpy as np
import pytest
from sqlmodel import Session, create_engine, select
from tinker import types
from tinker.proto.request_conv import forward_backward_request_to_proto
from tinker.proto.response_conv import (
    deserialize_forward_backward_output,
    deserialize_sample_response,
)

from gateway.db.tables import StabilityRecordRow, utcnow
from gateway.runs.stability_records import prune_expired
from tests.gateway import harness
from tests.gateway.tinker_rest import model, result, session

PROMPT = [5, 9, 12, 7, 30]
N_SAMPLES = 3
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def gw(make_gateway):
    env = make_gateway(metadata_only_min_bytes=0, gateway={"max_stability_records_per_session": 8})
    env.client.headers["X-API-Key"] = env.key("alice")
    return env


def _db(gw):
    return Session(create_engine(gw.db_url))


def _sampler(client, sid: str, seq: int = 0) -> str:
    r = client.post(
        "/api/v1/create_sampling_session",
        json={"session_id": sid, "sampling_session_seq_id": seq, "base_model": harness.BASE},
    )
    assert r.status_code == 200, r.text
    return r.json()["sampling_session_id"]


def _sample(client, sampler: str, seq_id: int, record: bool = True, n: int = N_SAMPLES):
    fut = client.post(
        "/api/v1/asample",
        json={
            "sampling_session_id": sampler,
            "seq_id": seq_id,
            "num_samples": n,
            "prompt": {"chunks": [{"type": "encoded_text", "tokens": PROMPT}]},
            "sampling_params": {"max_tokens": MAX_TOKENS, "temperature": 1.0, "seed": 7},
            "record_stability_info": record,
        },
    ).json()
    res = deserialize_sample_response(result(client, fut).content)
    return fut["sample_sequence_ids"], res.sequences


def _datum(seq, sid: str, prompt=PROMPT, adv: float = 1.0, spans=None) -> types.Datum:
    """rl_loop's datum (tinker-cookbook 0.6.1 recipes/rl_loop.py) with its provenance."""
    toks = list(seq.tokens)
    ob = len(prompt) - 1
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(prompt + toks[:-1]),
        loss_fn_inputs={
            "target_tokens": [0] * ob + toks,
            "logprobs": [0.0] * ob + list(seq.logprobs),
            "advantages": [0.0] * ob + [adv] * len(toks),
        },
    )
    model_spans, loss_spans = spans or (
        [
            types.PromptProvenanceSpan(sequence_id=sid, length=len(prompt)),
            types.SampledProvenanceSpan(sequence_id=sid, length=len(toks) - 1),
        ],
        [
            types.PromptProvenanceSpan(sequence_id=sid, offset=1, length=len(prompt) - 1),
            types.SampledProvenanceSpan(sequence_id=sid, length=len(toks)),
        ],
    )
    return types.Datum(
        model_input=datum.model_input,
        loss_fn_inputs=datum.loss_fn_inputs,
        model_input_spans=model_spans,
        loss_fn_input_spans=loss_spans,
    )


def _fb(client, model_id: str, seq_id: int, data, cfg=None):
    req = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(
            data=data, loss_fn="stable_reinforce", loss_fn_config=cfg
        ),
        model_id=model_id,
        seq_id=seq_id,
    )
    body = forward_backward_request_to_proto(req).SerializeToString()
    r = harness.post_fwdbwd(client, None, body)
    assert r.status_code == 200, r.text
    out = result(client, r.json())
    return out if isinstance(out, dict) else deserialize_forward_backward_output(out.content)


@pytest.fixture(scope="module")
def rl(gw):
    """A session with a model and a recording sampler, one sample taken."""
    client = gw.client
    sid = session(client)
    model_id = model(client, sid)
    sampler = _sampler(client, sid)
    ids, seqs = _sample(client, sampler, 0)
    return sid, model_id, sampler, ids, seqs


def test_sampling_records_the_servers_logprobs_under_each_sequence_id(gw, rl) -> None:
    sid, _, _, ids, seqs = rl
    assert len(ids) == len(set(ids)) == N_SAMPLES
    with _db(gw) as db:
        rows = {r.sequence_id: r for r in db.exec(select(StabilityRecordRow))}
    for seq_id, seq in zip(ids, seqs, strict=True):
        row = rows[seq_id]
        assert row.session_id == sid
        assert np.frombuffer(row.prompt, np.int32).tolist() == PROMPT
        assert np.frombuffer(row.tokens, np.int32).tolist() == list(seq.tokens)
        np.testing.assert_array_equal(np.frombuffer(row.logprobs, np.float32), seq.logprobs)
        assert row.expires_at - row.created_at == timedelta(days=1)


def test_without_the_flag_nothing_is_recorded(gw, rl) -> None:
    _, _, sampler, _, _ = rl
    ids, _ = _sample(gw.client, sampler, 1, record=False)
    with _db(gw) as db:
        assert not db.exec(
            select(StabilityRecordRow).where(StabilityRecordRow.sequence_id.in_(ids))  # type: ignore[attr-defined]
        ).all()


def test_stable_reinforce_trains_on_the_recorded_logprobs_and_restarts_the_day(gw, rl) -> None:
    sid, model_id, _, ids, seqs = rl
    with _db(gw) as db:  # age the records: a use restarts their day
        for row in db.exec(select(StabilityRecordRow)):
            row.expires_at = utcnow() + timedelta(hours=1)
            db.add(row)
        db.commit()
    # the client's own logprobs are not read: garbage there changes nothing
    data = [_datum(s, i) for s, i in zip(seqs, ids, strict=True)]
    out = _fb(gw.client, model_id, 1, data)
    m = out.metrics
    assert math.isfinite(m["loss:sum"]) and m["loss:sum"] != 0
    n = sum(len(s.tokens) for s in seqs)
    assert m["sr_sampled_tokens:sum"] == n
    # a fresh adapter is the sampler's model: ratios 1 up to the two paths' float noise
    assert m["sr_ratio:mean"] == pytest.approx(1.0, abs=1e-2)
    assert m["sr_masked_frac:mean"] == 0.0
    with _db(gw) as db:
        left = [r.expires_at - utcnow() for r in db.exec(select(StabilityRecordRow))]
    assert all(d > timedelta(hours=23) for d in left)


def _errors(seqs, ids, other_sid: str):
    """(name, datums, the message's expected part): one case per refusal."""
    s, i = seqs[0], ids[0]
    n = len(s.tokens)
    wrong = types.Datum(
        model_input=_datum(s, i).model_input,
        loss_fn_inputs={**_datum(s, i).loss_fn_inputs},
    )
    prompt_spans = [types.PromptProvenanceSpan(sequence_id=i, length=len(PROMPT))]
    sampled = types.SampledProvenanceSpan(sequence_id=i, length=n - 1)
    loss_spans = [
        types.PromptProvenanceSpan(sequence_id=i, offset=1, length=len(PROMPT) - 1),
        types.SampledProvenanceSpan(sequence_id=i, length=n),
    ]
    bad_prompt = [9, 9] + PROMPT[2:]
    return [
        (
            "no spans",
            [wrong],
            "data[0].loss_fn_input_spans: required by loss_fn 'stable_reinforce'",
        ),
        (
            "spans do not tile",
            [_datum(s, i, spans=(prompt_spans + [sampled], loss_spans[1:]))],
            f"data[0].loss_fn_input_spans: the spans cover {n} positions but target_tokens has",
        ),
        (
            "unknown sequence",
            [_datum(s, "nope:0")],
            "data[0].model_input_spans[0].prompt_tokens.sequence_id: 'nope:0' is not a sequence "
            "recorded in this session",
        ),
        (
            "another session's sequence",
            [_datum(s, other_sid)],
            f"data[0].model_input_spans[0].prompt_tokens.sequence_id: {other_sid!r} is not a "
            "sequence recorded in this session",
        ),
        (
            "past the sequence's end",
            [
                _datum(
                    s,
                    i,
                    spans=(
                        [
                            types.PromptProvenanceSpan(sequence_id=i, length=len(PROMPT) - 1),
                            types.SampledProvenanceSpan(sequence_id=i, offset=2, length=n),
                        ],
                        loss_spans,
                    ),
                )
            ],
            f"data[0].model_input_spans[1].sampled_tokens: offset 2 + length {n} runs past the "
            f"end of sequence {i!r}'s sampled tokens ({n} tokens)",
        ),
        (
            "tokens differ from the record",
            [_datum(s, i), _datum(s, i, prompt=bad_prompt)],
            f"data[1].model_input_spans[0].prompt_tokens: model_input token 9 at its position 0 "
            f"is not the token sequence {i!r} has there ({PROMPT[0]})",
        ),
        (
            "advantage on a prompt token",
            [_datum(s, i, adv=0.0)],
            None,  # accepted: zero advantages everywhere is a valid (no-op) datum
        ),
    ]


def test_bad_provenance_is_refused_naming_datum_and_span(gw, rl) -> None:
    sid, _, _, ids, seqs = rl
    client = gw.client
    model_id = model(client, sid, 1)
    # another session of the same user: its sequences are not this session's
    other = _sampler(client, session(client))
    other_ids, _ = _sample(client, other, 0)
    seq_id = 1
    for name, data, message in _errors(seqs, ids, other_ids[0]):
        out = _fb(client, model_id, seq_id, data)
        seq_id += 1
        if message is None:
            assert math.isfinite(out.metrics["loss:sum"]), name
            continue
        assert isinstance(out, dict) and message in out.get("error", ""), (name, out)
        assert out.get("category") == "user", (name, out)
    # the model keeps training after every refusal
    out = _fb(client, model_id, seq_id, [_datum(seqs[0], ids[0])])
    assert math.isfinite(out.metrics["loss:sum"])


def test_expired_sequence_is_refused(gw) -> None:
    client = gw.client
    sid = session(client)
    model_id = model(client, sid)
    ids, seqs = _sample(client, _sampler(client, sid), 0, n=1)
    with _db(gw) as db:
        row = db.exec(
            select(StabilityRecordRow).where(StabilityRecordRow.sequence_id == ids[0])
        ).one()
        row.expires_at = utcnow() - timedelta(seconds=1)
        db.add(row)
        db.commit()
    out = _fb(client, model_id, 1, [_datum(seqs[0], ids[0])])
    assert f"sequence_id: {ids[0]!r} has expired" in out["error"], out
    with _db(gw) as db:  # the sweep's pruning deletes it
        prune_expired(db)
        assert not db.exec(
            select(StabilityRecordRow).where(StabilityRecordRow.sequence_id == ids[0])
        ).all()


def test_records_are_capped_per_session_and_go_with_it(gw) -> None:
    """The cap (8 here) evicts the session's oldest; finishing the session drops the rest."""
    client = gw.client
    sid = session(client)
    sampler = _sampler(client, sid)
    first, _ = _sample(client, sampler, 0, n=5)
    second, _ = _sample(client, sampler, 1, n=5)
    with _db(gw) as db:
        kept = {
            r.sequence_id
            for r in db.exec(select(StabilityRecordRow).where(StabilityRecordRow.session_id == sid))
        }
    assert kept == set(first[2:] + second), kept
    r = client.post(f"/api/v1/sessions/{sid}/finish", json={})
    assert r.status_code == 200, r.text
    with _db(gw) as db:
        assert not db.exec(
            select(StabilityRecordRow).where(StabilityRecordRow.session_id == sid)
        ).all()


def test_json_wire_carries_the_spans(gw, rl) -> None:
    """The JSON body of older SDKs: spans in the proto's JSON mapping, resolved the same way."""
    sid, _, _, ids, seqs = rl
    client = gw.client
    model_id = model(client, sid, 2)
    seq, i = seqs[0], ids[0]
    d = _datum(seq, i)
    toks, ob = list(seq.tokens), len(PROMPT) - 1

    def tensor(values, dtype):
        return {"data": list(values), "dtype": dtype, "shape": [len(values)]}

    def span(kind, length, offset=0):
        return {kind: {"sequence_id": i, "offset": offset, "length": length}}

    datum = {
        "model_input": {"chunks": [{"type": "encoded_text", "tokens": d.model_input.to_ints()}]},
        "loss_fn_inputs": {
            "target_tokens": tensor([0] * ob + toks, "int64"),
            "advantages": tensor([0.0] * ob + [1.0] * len(toks), "float32"),
        },
        "model_input_spans": [
            span("prompt_tokens", len(PROMPT)),
            span("sampled_tokens", len(toks) - 1),
        ],
        "loss_fn_input_spans": [span("prompt_tokens", ob, 1), span("sampled_tokens", len(toks))],
    }
    body = {"data": [datum], "loss_fn": "stable_reinforce"}
    fut = client.post(
        "/api/v1/forward_backward",
        json={"model_id": model_id, "seq_id": 1, "forward_backward_input": body},
    ).json()
    out = harness.wait_future(client, None, fut, allow_metadata_only=False)
    out = deserialize_forward_backward_output(out.content) if not isinstance(out, dict) else out
    assert not isinstance(out, dict), out
    assert out.metrics["sr_sampled_tokens:sum"] == len(toks)
    both = dict(
        datum,
        model_input_spans=[
            {"prompt_tokens": span("x", 1)["x"], "sampled_tokens": span("x", 1)["x"]}
        ],
    )
    fut = client.post(
        "/api/v1/forward_backward",
        json={
            "model_id": model_id,
            "seq_id": 2,
            "forward_backward_input": {**body, "data": [both]},
        },
    )
    assert fut.status_code == 400, fut.text
    assert "data[0].model_input_spans[0]: must hold exactly one of" in fut.text


def test_recording_needs_a_sampling_session(gw) -> None:
    """A sample straight from a base model belongs to no client session: 400 naming the flag."""
    r = gw.client.post(
        "/api/v1/asample",
        json={
            "base_model": harness.BASE,
            "num_samples": 1,
            "prompt": {"chunks": [{"type": "encoded_text", "tokens": PROMPT}]},
            "sampling_params": {"max_tokens": 2},
            "record_stability_info": True,
        },
    )
    assert r.status_code == 400 and "record_stability_info: needs a sampling_session_id" in r.text
