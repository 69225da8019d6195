"""retrieve_future: long-poll a future, then answer its result, its error, or try_again."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request, Response

from gateway.deps import ConfigDep, EngineDep, FuturesDep, PrincipalDep
from gateway.errors import NotFoundError
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
    rec = futures.get(req.request_id, who.user_id)
    if rec is None:
        raise NotFoundError(f"request_id: future {req.request_id!r} not found (or expired)")
    if not await futures.wait(rec, config.long_poll_seconds):
        state, reason = "active", f"{rec.kind} is queued or running"
        base = rec.extra.get("base_model")
        if base and rec.idem_key is not None:
            try:
                status = await asyncio.wait_for(
                    engine.trainer(base, "status", rec.idem_key[0], rec.idem_key[1]), timeout=2
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
    if rec.error is not None:
        return {"error": rec.error, "category": rec.category}
    if rec.proto_result is not None:
        return Response(content=rec.proto_result, media_type="application/x-protobuf")
    return rec.json_result or {}
