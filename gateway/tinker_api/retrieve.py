"""retrieve_future: long-poll a future, then answer its result, its error, or try_again.

An expired future is 410 (the SDK resubmits a sample; for training it reaches the user). With
``allow_metadata_only`` a large finished result is first announced as ``complete_metadata`` with its
size, so the SDK can reserve its in-flight byte budget before it downloads the payload.
"""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request, Response

from gateway.deps import ConfigDep, EngineDep, FuturesDep, PrincipalDep
from gateway.engine_client import EngineClient
from gateway.errors import GoneError, NotFoundError
from gateway.futures.store import FutureRecord
from gateway.tinker_api import compat
from gateway.tinker_api.schemas import RetrieveFutureRequest

router = APIRouter(prefix="/api/v1")


@router.post("/retrieve_future", response_model=None)
async def retrieve_future(
    req: RetrieveFutureRequest,
    request: Request,
    who: PrincipalDep,
    futures: FuturesDep,
    config: ConfigDep,
    engine: EngineDep,
) -> Response | dict:
    """Long-poll a future: try_again, its error, its metadata, or its JSON / protobuf result."""
    found = await futures.find(req.request_id, who.user_id)
    if found == "expired":
        raise GoneError(
            f"request_id: future {req.request_id!r} expired (results are kept "
            f"{futures.result_ttl_s:.0f}s after they finish); resubmit the request"
        )
    if isinstance(found, str):
        raise NotFoundError(f"request_id: future {req.request_id!r} not found")
    rec = found
    done = await futures.wait(rec, config.long_poll_seconds)
    if done is None:
        return await _try_again(rec, engine)
    rec = done
    size = len(rec.proto_result) if rec.proto_result is not None else 0
    if rec.error is None and req.allow_metadata_only and size >= config.metadata_only_min_bytes:
        return {"status": "complete_metadata", "response_payload_size": size}  # not yet collected
    futures.collected(rec.request_id)
    if rec.error is not None:
        return {"error": rec.error, "category": rec.category}
    if rec.proto_result is not None and not compat.wants_protobuf(request):
        return compat.proto_result_as_json(rec.kind, rec.proto_result)  # SDK 0.16.x
    if rec.proto_result is not None:
        return Response(content=rec.proto_result, media_type="application/x-protobuf")
    return rec.json_result or {}


async def _try_again(rec: FutureRecord, engine: EngineClient) -> dict:
    """The answer for a future still running: where it stands in its Trainer queue, if known."""
    state, reason = "active", f"{rec.kind} is queued or running"
    base = rec.extra.get("base_model")
    if base and rec.idem_key is not None:
        try:
            status = await asyncio.wait_for(
                engine.trainer(base).status(rec.idem_key[0], seq_id=rec.idem_key[1]), timeout=2
            )
            state, reason = status["queue_state"], f"{rec.kind}: {status['reason']}"
        except Exception:  # status is best effort; the poll itself must not fail
            pass
    return {
        "type": "try_again",
        "request_id": rec.request_id,
        "queue_state": state,
        "queue_state_reason": reason,
    }
