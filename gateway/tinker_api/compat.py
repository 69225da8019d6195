"""Older Tinker SDKs (the JSON wire format of the 0.16.x line): JSON forward/backward bodies, the
separate `/forward` and `/unload_model` routes, and JSON results where 0.38 gets protobuf.

The JSON bodies are validated with the current SDK's own wire types and encoded into the same
protobuf request the 0.38 SDK sends, so one decoder (proto_codec) serves both. A finished result
that is protobuf is sent as JSON to a client that accepts JSON but not protobuf (the 0.38 SDK
accepts protobuf for those two result types; older ones send `Accept: application/json`).
"""

from __future__ import annotations

import math
from typing import Any, Literal

import numpy as np
from fastapi import APIRouter, Request
from pydantic import Field, ValidationError

from gateway.deps import DbDep, EngineDep, FuturesDep, PrincipalDep, owned_run
from gateway.errors import InvalidRequestError
from gateway.errors import format_validation_errors as _format  # one wording for 400s
from gateway.images import json_image_chunk
from gateway.tinker_api.schemas import FutureResponse, ModelInputWire, WireRequest, returns
from gateway.tinker_api.wire_pb import pb

router = APIRouter(prefix="/api/v1")


class UnloadModelRequest(WireRequest):
    model_id: str


class TensorWire(WireRequest):
    data: list[float]
    dtype: Literal["int64", "float32"]
    shape: list[int] | None = None


class SpanRunWire(WireRequest):
    sequence_id: str
    offset: int = Field(0, ge=0)
    length: int = Field(ge=0)


class ProvenanceSpanWire(WireRequest):
    """One provenance run as the proto's JSON mapping spells it: exactly one of the two arms."""

    prompt_tokens: SpanRunWire | None = None
    sampled_tokens: SpanRunWire | None = None


class DatumWire(WireRequest):
    model_input: ModelInputWire
    loss_fn_inputs: dict[str, TensorWire] = Field(default_factory=dict)
    model_input_spans: list[ProvenanceSpanWire] | None = None
    loss_fn_input_spans: list[ProvenanceSpanWire] | None = None


def _spans_to_proto(spans: list[ProvenanceSpanWire] | None, out, where: str) -> None:
    for j, span in enumerate(spans or ()):
        arms = [k for k in ("prompt_tokens", "sampled_tokens") if getattr(span, k) is not None]
        if len(arms) != 1:
            raise InvalidRequestError(
                f"{where}[{j}]: must hold exactly one of prompt_tokens, sampled_tokens"
            )
        run = getattr(span, arms[0])
        arm = getattr(out.add(), arms[0])
        arm.sequence_id, arm.offset, arm.length = run.sequence_id, run.offset, run.length


class ForwardBackwardInputWire(WireRequest):
    data: list[DatumWire]
    loss_fn: str = "cross_entropy"
    loss_fn_config: dict[str, float | str] | None = None


class ForwardBackwardRequestWire(WireRequest):
    forward_backward_input: ForwardBackwardInputWire
    model_id: str
    seq_id: int | None = None


def json_forward_backward_to_proto(payload: Any, *, forward_only: bool = False) -> bytes:
    """A 0.16-style JSON ForwardBackwardRequest (or ForwardRequest) as 0.38 protobuf bytes."""
    if not isinstance(payload, dict):
        raise InvalidRequestError("body: expected a JSON object")
    payload = dict(payload)
    if "forward_input" in payload:  # the /forward route's name for the same input
        payload["forward_backward_input"] = payload.pop("forward_input")
        forward_only = True
    try:
        req = ForwardBackwardRequestWire.model_validate(payload)
    except ValidationError as exc:
        message, _ = _format(exc.errors())
        raise InvalidRequestError(message) from None
    msg = pb.ForwardBackwardRequest(
        model_id=req.model_id,
        seq_id=req.seq_id or 0,
        loss_fn=req.forward_backward_input.loss_fn,
        forward_only=forward_only,
    )
    for k, v in (req.forward_backward_input.loss_fn_config or {}).items():
        if isinstance(v, str):
            msg.loss_fn_config_v2[k].text = v
        else:
            msg.loss_fn_config_v2[k].number = float(v)
    for i, d in enumerate(req.forward_backward_input.data):
        dm = msg.data.add()
        for j, chunk in enumerate(d.model_input.chunks):
            where = f"forward_backward_input.data[{i}].model_input.chunks[{j}]"
            kind = chunk.get("type", "encoded_text")
            if kind == "image":
                data, fmt, expected = json_image_chunk(chunk, where)
                img = dm.model_input.add().image
                img.data, img.format = data, fmt
                if expected is not None:
                    img.expected_tokens = expected
                continue
            toks = chunk.get("tokens")
            if kind != "encoded_text" or not isinstance(toks, list):
                raise InvalidRequestError(
                    f"{where}: only encoded_text chunks with a tokens list and image chunks are "
                    "supported"
                )
            dm.model_input.add().encoded_text.tokens = np.asarray(toks, dtype=np.int32).tobytes()
        for name, t in d.loss_fn_inputs.items():
            np_dtype = np.int64 if t.dtype == "int64" else np.float32
            arr = np.asarray(t.data, dtype=np_dtype)
            shape = t.shape or [arr.size]
            if math.prod(shape) != arr.size:
                raise InvalidRequestError(
                    f"forward_backward_input.data[{i}].loss_fn_inputs.{name}: shape {shape} "
                    f"does not match {arr.size} values"
                )
            tm = dm.loss_fn_inputs[name]
            tm.dense = arr.tobytes()
            tm.dtype = pb.DTYPE_INT64 if t.dtype == "int64" else pb.DTYPE_FLOAT32
            tm.shape.extend(shape)
        where = f"forward_backward_input.data[{i}]"
        _spans_to_proto(d.model_input_spans, dm.model_input_spans, f"{where}.model_input_spans")
        _spans_to_proto(
            d.loss_fn_input_spans, dm.loss_fn_input_spans, f"{where}.loss_fn_input_spans"
        )
    return msg.SerializeToString()


_NP = {pb.DTYPE_FLOAT32: np.float32, pb.DTYPE_INT64: np.int64, pb.DTYPE_INT32: np.int32}


def proto_result_as_json(kind: str, proto: bytes) -> dict:
    """The JSON a 0.16-line SDK validates, for a protobuf result of ``kind``."""
    if kind == "sample":
        msg = pb.SampleResponse()
        msg.ParseFromString(proto)
        out: dict[str, Any] = {
            "type": "sample",
            "sequences": [
                {
                    "stop_reason": "stop" if s.stop_reason == pb.STOP_REASON_STOP else "length",
                    "tokens": np.frombuffer(s.tokens, dtype=np.int32).tolist(),
                    "logprobs": np.frombuffer(s.logprobs, dtype=np.float32).tolist(),
                }
                for s in msg.sequences
            ],
        }
        if msg.HasField("prompt_logprobs"):
            lps = np.frombuffer(msg.prompt_logprobs, dtype=np.float32).tolist()
            out["prompt_logprobs"] = [None if math.isnan(x) else x for x in lps]
        return out
    msg = pb.ForwardBackwardOutput()
    msg.ParseFromString(proto)
    outputs: list[dict[str, Any]] = []
    for record in msg.loss_fn_outputs:
        per: list[dict[str, Any]] = [{} for _ in range(record.num_datums)]
        for name, bt in record.fields.items():
            dtype = _NP[bt.dtype]
            offsets = np.frombuffer(bt.offsets, dtype=np.int64)
            trailing = list(bt.trailing_shape)
            for i in range(record.num_datums):
                arr = np.frombuffer(bt.data[offsets[i] : offsets[i + 1]], dtype=dtype)
                lead = arr.size // max(1, math.prod(trailing)) if trailing else arr.size
                per[i][name] = {
                    "data": arr.tolist(),
                    "dtype": "int64" if dtype is not np.float32 else "float32",
                    "shape": [lead, *trailing],
                }
        outputs += per
    return {
        "loss_fn_output_type": msg.loss_fn_output_type,
        "loss_fn_outputs": outputs,
        "metrics": dict(msg.metrics),
    }


def wants_protobuf(request: Request) -> bool:
    """False only for a client that asks for JSON and not protobuf (SDK 0.16.x sends
    ``Accept: application/json``; 0.38 sends ``application/x-protobuf`` for these results)."""
    accept = request.headers.get("accept", "")
    return "application/x-protobuf" in accept or "application/json" not in accept


@router.post("/unload_model", **returns(FutureResponse))
async def unload_model(
    req: UnloadModelRequest, who: PrincipalDep, db: DbDep, engine: EngineDep, futures: FuturesDep
) -> dict:
    """0.16.x: release a model's adapter (saved checkpoints stay)."""
    run = owned_run(db, who, req.model_id)

    async def run_() -> tuple[str, object]:
        await engine.trainer(run.base_model).delete_adapter(run.id)
        return "json", {"model_id": run.id, "type": "unload_model"}

    rec = await futures.submit(user_id=who.user_id, kind="unload_model", run=run_)
    return {"request_id": rec.request_id, "model_id": run.id}
