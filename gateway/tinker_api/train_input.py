"""The input of a forward / forward_backward request, from its body to the engine's decoded input,
under the per-request budgets.

Owns: reading the body (zstd inflated to at most ``gateway.max_request_body_mb``; the JSON of
older SDKs sized before it is parsed), `plan` (what the request will hold once decoded, checked
on the compact protobuf message before anything is expanded: ``gateway.max_datums_per_request``,
``gateway.max_decoded_request_mb``, and only the ``loss_fn_inputs`` its loss reads), and `decode`
(the expansion itself, off the event loop).

The sizes are checked before the claim on the request's seq_id, but a refusal is raised by the
route's prepare step (`Planned.error`), so the seq_id still passes the model's order.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass

import zstandard
from fastapi import Request

from engine.protocol import ForwardBackwardInput
from engine.rules import CUSTOM_LOSS_FN, loss_fn_input_names
from gateway.config import GatewayConfig
from gateway.context import RequestContext
from gateway.db.tables import TrainingRunRow
from gateway.errors import InvalidRequestError, PayloadTooLargeError
from gateway.tinker_api import compat, custom_losses
from gateway.tinker_api.proto_codec import (
    DECODED_BUDGET_KEY,
    check_decoded_size,
    decode_forward_backward,
    loss_fn_config,
    parse_forward_backward,
)
from gateway.tinker_api.wire_pb import pb

#: what one JSON value costs once parsed, before it becomes a tensor: a Python float or int
#: (24-32 bytes) and its list slot (8). A 64 MiB body of ``0,`` is 32 M values: ~1 GiB.
JSON_VALUE_BYTES = 32
_INFLATE_CHUNK = 1 << 20


@dataclass
class Planned:
    """A parsed request and what decoding it will take. ``error``: a user error that fails its
    seq_id in order (raised by the route's prepare step)."""

    msg: pb.ForwardBackwardRequest
    keep: frozenset[str]
    graph: dict | None = None
    nbytes: int = 0
    error: InvalidRequestError | PayloadTooLargeError | None = None


async def read_body(request: Request, gw: GatewayConfig) -> bytes:
    """The protobuf ForwardBackwardRequest of a request (older SDKs' JSON is converted)."""
    ctype = request.headers.get("content-type", "")
    max_bytes = gw.max_request_body_mb * 2**20
    if "json" in ctype:  # the JSON wire format of older SDKs
        raw = await _inflated(request, max_bytes)
        _check_json_size(raw, gw.max_decoded_request_mb * 2**20)
        try:
            payload = json.loads(raw)
        except ValueError:
            raise InvalidRequestError("body: invalid JSON") from None
        return compat.json_forward_backward_to_proto(
            payload, forward_only=request.url.path.endswith("/forward")
        )
    if "protobuf" in ctype:
        return await _inflated(request, max_bytes)
    raise InvalidRequestError(
        "content-type: forward_backward takes an application/x-protobuf "
        "ForwardBackwardRequest (or the JSON of older SDKs)"
    )


async def _inflated(request: Request, max_bytes: int) -> bytes:
    """The body, zstd-inflated when so encoded, to at most ``max_bytes`` (413 past it). Inflated
    as a stream: a frame that declares its size is otherwise inflated whole, whatever the cap
    (a 327-byte frame declared 10 MB)."""
    body = await request.body()
    if request.headers.get("content-encoding", "").lower() != "zstd":
        return body
    chunks, total = [], 0
    try:
        with zstandard.ZstdDecompressor().stream_reader(body) as reader:
            while chunk := reader.read(_INFLATE_CHUNK):
                total += len(chunk)
                if total > max_bytes:
                    raise PayloadTooLargeError(
                        f"body: inflates to more than {max_bytes} bytes, over this server's "
                        "limit (gateway.max_request_body_mb); send smaller requests"
                    )
                chunks.append(chunk)
    except zstandard.ZstdError:
        raise InvalidRequestError("body: invalid zstd data") from None
    return b"".join(chunks)


def _check_json_size(raw: bytes, max_bytes: int) -> None:
    """413 when a JSON body may hold more values than the decoded budget allows, counted before
    it is parsed: every value but the first of an array follows a comma."""
    values = raw.count(b",") + raw.count(b"[")
    if values * JSON_VALUE_BYTES > max_bytes:
        raise PayloadTooLargeError(
            f"body: this JSON request holds up to {values} values, ~{values * JSON_VALUE_BYTES} "
            f"bytes once parsed, over this server's limit of {max_bytes} bytes per request "
            f"({DECODED_BUDGET_KEY}); send protobuf (tinker >= 0.38 does) or split the batch"
        )


def parse(body: bytes) -> pb.ForwardBackwardRequest:
    """The compact message, or a 400 when it names no model or seq_id (nothing to fail in
    order)."""
    msg = parse_forward_backward(body)
    if not msg.model_id:
        raise InvalidRequestError("model_id: required")
    if msg.seq_id < 1:
        raise InvalidRequestError(f"seq_id: must be ≥ 1, got {msg.seq_id}")
    return msg


def plan(t: RequestContext, run: TrainingRunRow, msg: pb.ForwardBackwardRequest) -> Planned:
    """What decoding ``msg`` for ``run`` takes: the loss_fn_inputs its loss reads (a custom
    loss's stored graph names them), their size against the budget. Allocates nothing."""
    out = Planned(msg, frozenset())
    gw = t.config.gateway
    try:
        if len(msg.data) > gw.max_datums_per_request:
            raise PayloadTooLargeError(
                f"forward_backward_input.data: {len(msg.data)} datums, over this server's limit "
                f"of {gw.max_datums_per_request} per request (gateway.max_datums_per_request); "
                "split the batch"
            )
        loss_fn = msg.loss_fn or "cross_entropy"
        if loss_fn == CUSTOM_LOSS_FN:
            out.graph = custom_losses.attached_graph(t, run, loss_fn_config(msg))
        out.keep = loss_fn_input_names(loss_fn, out.graph["inputs"] if out.graph else None)
        out.nbytes = check_decoded_size(msg, out.keep, gw.max_decoded_request_mb * 2**20)
    except (InvalidRequestError, PayloadTooLargeError) as exc:
        out.error, out.nbytes = exc, 0
    return out


async def decode(p: Planned) -> ForwardBackwardInput:
    """The engine input of a planned request, expanded in a worker thread (up to the decoded
    budget: ~0.1 s for 256 MiB, too long to hold the event loop)."""
    if p.error is not None:
        raise p.error
    return (await asyncio.to_thread(decode_forward_backward, p.msg, p.keep))[2]
