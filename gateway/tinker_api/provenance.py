"""Provenance spans of ``stable_reinforce`` training requests, checked against the stability
records of the caller's session (gateway/runs/stability_records.py) and resolved into the
engine's ``recorded_logprobs`` / ``recorded_mask`` inputs (engine/rules.py), so the engine needs
no access to the records.

Owns `resolve`. Every check runs before any compute; each refusal is an `InvalidRequestError`
naming ``data[i].<field>[j]``: the spans of a field tile it exactly, each names a sequence
recorded in the caller's session that has not expired, its run lies inside that sequence's prompt
(a ``prompt_tokens`` span) or sampled tokens (``sampled_tokens``), and the request's tokens there
are the recorded ones: the model input's under both kinds, the targets' under ``sampled_tokens``.
Targets under a ``prompt_tokens`` span are not compared: they carry no training signal (the loss
refuses nonzero advantages off sampled tokens), and tinker-cookbook's ``rl_loop`` sends 0 there.
A sequence of another session reads as not recorded, so no session learns another's ids.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from sqlmodel import Session

from engine.rules import RECORDED_LOGPROBS, RECORDED_MASK
from gateway.db.tables import StabilityRecordRow, utcnow
from gateway.errors import InvalidRequestError
from gateway.runs import stability_records
from gateway.tinker_api.proto_codec import decode_tensor, model_input_chunks
from gateway.tinker_api.wire_pb import pb

_KINDS = ("prompt_tokens", "sampled_tokens")


@dataclass(frozen=True)
class _Seq:
    prompt: np.ndarray
    tokens: np.ndarray
    logprobs: np.ndarray


@dataclass(frozen=True)
class _Span:
    where: str
    kind: str
    sequence_id: str
    offset: int
    length: int


def _spans(spans, where: str) -> list[_Span]:
    out = []
    for j, s in enumerate(spans):
        kind = s.WhichOneof("span")
        w = f"{where}[{j}]"
        if kind not in _KINDS:
            raise InvalidRequestError(f"{w}: names neither prompt_tokens nor sampled_tokens")
        arm = getattr(s, kind)
        w = f"{w}.{kind}"
        if not arm.sequence_id:
            raise InvalidRequestError(f"{w}.sequence_id: required")
        if arm.offset < 0 or arm.length < 0:
            raise InvalidRequestError(
                f"{w}: offset {arm.offset} and length {arm.length} must be >= 0"
            )
        out.append(_Span(w, kind, arm.sequence_id, int(arm.offset), int(arm.length)))
    return out


def _datum_spans(d: pb.Datum, i: int) -> tuple[list[_Span], list[_Span]]:
    if not len(d.model_input_spans) and not len(d.loss_fn_input_spans):
        raise InvalidRequestError(
            f"data[{i}].loss_fn_input_spans: required by loss_fn 'stable_reinforce' (with "
            "model_input_spans): name the sampled sequence behind each position "
            "(Datum.with_provenance), sampled by a client with record_stability_info=True"
        )
    return (
        _spans(d.model_input_spans, f"data[{i}].model_input_spans"),
        _spans(d.loss_fn_input_spans, f"data[{i}].loss_fn_input_spans"),
    )


def _check_tiling(spans: list[_Span], n: int, field: str, what: str) -> None:
    total = sum(s.length for s in spans)
    if total != n:
        raise InvalidRequestError(
            f"{field}: the spans cover {total} positions but {what} has {n}; the runs must "
            "tile it exactly, in order"
        )


def _sequence(rows: dict[str, StabilityRecordRow], span: _Span, ttl_s: float) -> _Seq:
    row = rows.get(span.sequence_id)
    if row is None:
        raise InvalidRequestError(
            f"{span.where}.sequence_id: {span.sequence_id!r} is not a sequence recorded in this "
            "session (sample with record_stability_info=True in the same session; records "
            "are kept per session and the oldest are evicted past "
            "gateway.max_stability_records_per_session)"
        )
    if row.expires_at < utcnow():
        raise InvalidRequestError(
            f"{span.where}.sequence_id: {span.sequence_id!r} has expired (records are kept "
            f"{ttl_s:.0f} s after their last use by a training request); sample it again"
        )
    return _Seq(
        np.frombuffer(row.prompt, dtype=np.int32),
        np.frombuffer(row.tokens, dtype=np.int32),
        np.frombuffer(row.logprobs, dtype=np.float32),
    )


def _run(seq: _Seq, span: _Span) -> np.ndarray:
    """The recorded tokens the span names (400 past the sequence's end)."""
    source = seq.prompt if span.kind == "prompt_tokens" else seq.tokens
    if span.offset + span.length > len(source):
        what = "prompt" if span.kind == "prompt_tokens" else "sampled tokens"
        raise InvalidRequestError(
            f"{span.where}: offset {span.offset} + length {span.length} runs past the end of "
            f"sequence {span.sequence_id!r}'s {what} ({len(source)} tokens)"
        )
    return source[span.offset : span.offset + span.length]


def _match(span: _Span, got: np.ndarray, recorded: np.ndarray, field: str) -> None:
    bad = np.flatnonzero(got != recorded)
    if bad.size:
        k = int(bad[0])
        raise InvalidRequestError(
            f"{span.where}: {field} token {int(got[k])} at its position {k} is not the token "
            f"sequence {span.sequence_id!r} has there ({int(recorded[k])})"
        )


def _resolve_datum(
    d: pb.Datum, i: int, model_spans: list[_Span], loss_spans: list[_Span], seqs
) -> None:
    """Check datum ``i`` against its sequences; write its recorded_* inputs."""
    tokens, images = model_input_chunks(d.model_input, f"data[{i}].model_input")
    if images:
        raise InvalidRequestError(
            f"data[{i}].model_input: image chunks cannot be matched to recorded sequences; "
            "stable_reinforce takes text datums"
        )
    if "target_tokens" not in d.loss_fn_inputs:
        raise InvalidRequestError(f"data[{i}].loss_fn_inputs.target_tokens: required")
    where = f"data[{i}].loss_fn_inputs.target_tokens"
    targets = decode_tensor(d.loss_fn_inputs["target_tokens"], where)
    if targets.ndim != 1:
        raise InvalidRequestError(f"{where}: must be 1-D for stable_reinforce")
    _check_tiling(model_spans, len(tokens), f"data[{i}].model_input_spans", "model_input")
    _check_tiling(loss_spans, len(targets), f"data[{i}].loss_fn_input_spans", "target_tokens")
    toks = np.asarray(tokens, dtype=np.int64)
    pos = 0
    for span in model_spans:
        run = _run(seqs[span.sequence_id], span)
        _match(span, toks[pos : pos + span.length], run, "model_input")
        pos += span.length
    q = np.zeros(len(targets), np.float32)
    mask = np.zeros(len(targets), np.float32)
    pos = 0
    for span in loss_spans:
        seq = seqs[span.sequence_id]
        run = _run(seq, span)
        if span.kind == "sampled_tokens":
            _match(span, targets[pos : pos + span.length], run, "target")
            q[pos : pos + span.length] = seq.logprobs[span.offset : span.offset + span.length]
            mask[pos : pos + span.length] = 1.0
        pos += span.length
    for name, arr in ((RECORDED_LOGPROBS, q), (RECORDED_MASK, mask)):
        t = d.loss_fn_inputs[name]
        t.Clear()  # what a client sent under these names is replaced
        t.dense, t.dtype = arr.tobytes(), pb.DTYPE_FLOAT32
        t.shape.append(len(arr))


def resolve(db: Session, session_id: str, msg: pb.ForwardBackwardRequest, ttl_s: float) -> None:
    """Check every datum's spans against the records of ``session_id`` and write its
    ``recorded_logprobs`` / ``recorded_mask`` into ``msg``; restart the named records' day."""
    spans = [_datum_spans(d, i) for i, d in enumerate(msg.data)]
    ids = {s.sequence_id for pair in spans for group in pair for s in group}
    rows = stability_records.load(db, session_id, ids)
    seqs = {}
    for pair in spans:
        for span in (*pair[0], *pair[1]):
            if span.sequence_id not in seqs:
                seqs[span.sequence_id] = _sequence(rows, span, ttl_s)
    for i, (d, (model_spans, loss_spans)) in enumerate(zip(msg.data, spans, strict=True)):
        _resolve_datum(d, i, model_spans, loss_spans, seqs)
    stability_records.touch(db, ids, ttl_s)
