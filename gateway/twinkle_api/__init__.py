"""The native Twinkle API (``/api/v1/twinkle/...``) for `twinkle_client`: management, models
that mirror the engine's `MultiLoraTransformersModel` (hosted by the Trainer that holds their
adapters, engine/native/; the gateway keeps who owns them), sampling and encoding. Shares the
engine, auth, ownership and checkpoints with the Tinker routes.

Routes (all need an API key; other users' ids answer 404)::

    POST   create_session, session_heartbeat           sessions (shared table with Tinker)
    GET    get_server_capabilities, capacity_info
    GET    training_runs, training_runs/{id}, training_runs/{id}/checkpoints
    GET    checkpoint?path=   DELETE checkpoint?path=  by twinkle:// or tinker:// path
    GET    tokenizer?base_model=, tokenizer/{file}?base_model=
    POST   model/create {session_id, base_model}       -> model_id
    POST   model/{method} {model_id, adapter_name, kwargs}   engine-class methods
    POST   model/close {model_id}
    POST   encode, sample, sampler/set_template
"""

from fastapi import APIRouter

from gateway.twinkle_api import management, model_routes, sampling

router = APIRouter()
for _module in (management, sampling, model_routes):
    router.include_router(_module.router)

__all__ = ["router"]
