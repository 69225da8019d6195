"""retrieve_future: long-poll a future, then answer its result, its error, or try_again."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response

from gateway.deps import ConfigDep, FuturesDep, PrincipalDep
from gateway.errors import NotFoundError
from gateway.tinker_api.schemas import RetrieveFutureRequest

router = APIRouter(prefix="/api/v1")


@router.post("/retrieve_future", response_model=None)
async def retrieve_future(
    req: RetrieveFutureRequest, request: Request, who: PrincipalDep, futures: FuturesDep,
    config: ConfigDep,
) -> Response | dict:
    rec = futures.get(req.request_id, who.user_id)
    if rec is None:
        raise NotFoundError(f"request_id: future {req.request_id!r} not found (or expired)")
    if not await futures.wait(rec, config.long_poll_seconds):
        return {
            "type": "try_again",
            "request_id": rec.request_id,
            "queue_state": "active",
            "queue_state_reason": f"{rec.kind} is queued or running",
        }
    if rec.error is not None:
        return {"error": rec.error, "category": rec.category}
    if rec.proto_result is not None:
        return Response(content=rec.proto_result, media_type="application/x-protobuf")
    return rec.json_result or {}
