"""Tinker save endpoints: save_weights (training state) and save_weights_for_sampler (named or
ephemeral, backing a sampler), and `prepare_save`, which save_weights_external uses too.

A save is `gateway.training.checkpoints`' three steps: reserve before submit, then (in the
future, in the model's seq_id order in the Trainer) write and record. A refused save still passes
its seq_id (`sequenced.submit_sequenced`).
"""

from __future__ import annotations

from fastapi import APIRouter

from gateway.context import ContextDep, RequestContext
from gateway.db.tables import TrainingRunRow
from gateway.deps import owned_run
from gateway.errors import InvalidRequestError
from gateway.futures.store import fingerprint
from gateway.runs.checkpoints import validate_name
from gateway.tinker_api.schemas import (
    FutureResponse,
    SaveWeightsForSamplerRequest,
    SaveWeightsRequest,
    returns,
)
from gateway.tinker_api.sequenced import Run, future_json, submit_sequenced
from gateway.training import checkpoints
from gateway.training.checkpoints import Reservation, SaveSpec

router = APIRouter(prefix="/api/v1")
#: ephemeral sampler weights expire after a day: they only back that sampling session
EPHEMERAL_TTL_S = 86400


async def run_save(
    t: RequestContext, run: TrainingRunRow, seq_id: int, spec: SaveSpec, res: Reservation
) -> int:
    """Write the state in seq order (`checkpoints.write`: commit or release, usage). Returns the
    size in bytes."""

    async def save_state() -> int:
        return await t.engine.trainer(run.base_model).save_state(
            run.id,
            seq_id=seq_id,
            directory=str(res.directory),
            include_optimizer=spec.include_optimizer,
            age_recipients=spec.age_recipients,
        )

    return await checkpoints.write(t, run, spec, res, save_state)


def save_result(spec: SaveSpec, res: Reservation, size: int) -> dict:
    """The future's JSON result, per save route."""
    if spec.sampling_session_id is not None:
        return {"sampling_session_id": spec.sampling_session_id}
    if spec.kind == "external":
        return {"path": res.parsed.tinker_path, "size_bytes": size}
    rtype = "save_weights" if spec.kind == "training" else "save_weights_for_sampler"
    return {"path": res.parsed.tinker_path, "type": rtype}


async def prepare_save(t: RequestContext, run: TrainingRunRow, seq_id: int, spec: SaveSpec) -> Run:
    """Reserve now; the returned coroutine runs and records the save."""
    res = await checkpoints.reserve(t, run, spec)
    bind = t.db.get_bind()

    async def run_() -> tuple[str, object]:
        size = await run_save(t, run, seq_id, spec, res)
        checkpoints.record(bind, t.who.user_id, run, spec, res, size)
        return "json", save_result(spec, res, size)

    return run_


@router.post("/save_weights", **returns(FutureResponse))
async def save_weights(req: SaveWeightsRequest, t: ContextDep) -> dict:
    """Save the model's training state (weights and optimizer) under weights/<path>."""
    fp = fingerprint(req.model_dump(mode="json"))
    run = owned_run(t.db, t.who, req.model_id, live=True)

    async def prepare() -> Run:
        spec = SaveSpec(
            kind="training",
            name=validate_name(req.path or "", "path"),
            overwrite=req.overwrite,
            ttl_seconds=req.ttl_seconds,
            user_metadata=req.user_metadata,
            include_optimizer=True,
        )
        return await prepare_save(t, run, req.seq_id, spec)

    rec = await submit_sequenced(t, run, req.seq_id, fp, "save", prepare)
    return future_json(rec, run.id)


@router.post("/save_weights_for_sampler", **returns(FutureResponse))
async def save_weights_for_sampler(req: SaveWeightsForSamplerRequest, t: ContextDep) -> dict:
    """Save sampler weights: named (sampler_weights/<path>) or ephemeral, backing a new sampler."""
    fp = fingerprint(req.model_dump(mode="json"))
    run = owned_run(t.db, t.who, req.model_id, live=True)

    async def prepare() -> Run:
        return await prepare_save(t, run, req.seq_id, _sampler_spec(req, run))

    rec = await submit_sequenced(t, run, req.seq_id, fp, "save", prepare)
    return future_json(rec, run.id)


def _sampler_spec(req: SaveWeightsForSamplerRequest, run: TrainingRunRow) -> SaveSpec:
    """A named save (overwrites), or an ephemeral one for sampling_session_seq_id."""
    if req.path is not None:
        name = validate_name(req.path, "path")
        return SaveSpec("sampler", name, True, req.ttl_seconds, req.user_metadata, False)
    if req.sampling_session_seq_id is None:
        raise InvalidRequestError(
            "path: give a name, or sampling_session_seq_id for an ephemeral save"
        )
    return SaveSpec(
        kind="sampler",
        name=f"ephemeral-{req.sampling_session_seq_id}",
        overwrite=True,
        ttl_seconds=EPHEMERAL_TTL_S,
        user_metadata=req.user_metadata,
        include_optimizer=False,
        ephemeral=True,
        sampling_session_id=f"{run.session_id}:sample:{req.sampling_session_seq_id}",
    )
