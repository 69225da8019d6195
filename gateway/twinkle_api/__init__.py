"""The native Twinkle API: upstream Twinkle's own protocol (twinkle-kit 0.5.1's `twinkle_client`,
and ours, which speaks the same), sharing the engine, auth, quotas, ownership and checkpoints with
the Tinker routes.

Routes (all need an API key; model and sampler calls also the caller's ``X-Twinkle-Session-Id``;
other users' sessions, runs and checkpoints answer 404)::

    /api/v1/twinkle/          management.py: create_session, session_heartbeat,
                              get_server_capabilities, capacity_info, training_runs[/{id}[/
                              checkpoints]], checkpoint?path=, tokenizer[/{file}]
                              sampling.py: encode (the data toolkit's templates)
    /api/v1/model/<base>/twinkle/<method>     model_routes.py (+ model_calls.py): create, then
                              the methods of the engine's MultiLoraTransformersModel
    /api/v1/sampler/<base>/twinkle/<method>   sampler_routes.py: create, set_template, sample,
                              sample_stream
"""

from fastapi import APIRouter

from gateway.twinkle_api import management, model_routes, sampler_routes, sampling

router = APIRouter()
for _module in (management, sampling, model_routes, sampler_routes):
    router.include_router(_module.router)

__all__ = ["router"]
