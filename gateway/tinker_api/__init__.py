"""The Tinker-compatible API (`/api/v1/...`), spoken by the unmodified tinker SDK.

Exports one `router`; the order of its modules is the order their routes are tried: exports and
checkpoints before runs, because their ``.../{checkpoint_id:path}/publish|ttl|...`` routes must
be tried before runs' ``DELETE .../{checkpoint_id:path}``.
"""

from fastapi import APIRouter

from gateway.tinker_api import (
    checkpoints,
    compat,
    custom_losses,
    exports,
    retrieve,
    runs,
    sampling,
    saves,
    session_queries,
    session_search,
    session_traces,
    sessions,
    training,
)

router = APIRouter()
for _module in (
    sessions,
    session_search,
    session_queries,
    session_traces,
    training,
    custom_losses,
    saves,
    exports,
    sampling,
    retrieve,
    compat,
    checkpoints,
    runs,
):
    router.include_router(_module.router)

__all__ = ["router"]
