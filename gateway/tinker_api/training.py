"""Tinker training endpoints: create_model, get_info, forward_backward (and 0.16.x's forward),
optim_step, load_weights. Saves are in `saves.py`, exports in `exports.py`; the submit path they
all share (claim, touch, quota, submit or reject in order) is `sequenced.py`.

Every sequenced request becomes a future that passes through the Trainer's seq_id ordering, even
when it is rejected (a rejected seq_id must still advance the model's sequence, or every later
request would wait for it).
"""

from __future__ import annotations

from fastapi import APIRouter, Request

from engine.protocol import AdamParams, LoraSpec
from engine.rules import STABLE_REINFORCE
from gateway.context import ContextDep, RequestContext
from gateway.db.tables import TrainingRunRow
from gateway.deps import owned_run, owned_session
from gateway.errors import InvalidRequestError, NotFoundError
from gateway.futures.store import fingerprint
from gateway.images import check_images
from gateway.runs.checkpoints import readable_checkpoint
from gateway.runs.request_log import trace_tag
from gateway.tinker_api import jobs, provenance, train_input
from gateway.tinker_api.proto_codec import check_decoded_size, image_token_count
from gateway.tinker_api.schemas import (
    CreateModelRequest,
    FutureResponse,
    GetInfoRequest,
    GetInfoResponse,
    LoadWeightsRequest,
    OptimStepRequest,
    returns,
)
from gateway.tinker_api.sequenced import Prepared, Run, future_json, submit_once, submit_sequenced
from gateway.training import metering, runs

router = APIRouter(prefix="/api/v1")


def _lora_spec(req: CreateModelRequest, t: RequestContext) -> LoraSpec:
    """The adapter of a create_model request, or a 400 naming the field."""
    model_cfg = t.config.model(req.base_model)
    if model_cfg is None:
        raise InvalidRequestError(
            f"base_model: {req.base_model!r} is not served here; available: "
            f"{[m.name for m in t.config.models]}"
        )
    rank = req.lora_config.rank
    if rank & (rank - 1):
        raise InvalidRequestError(f"lora_config.rank must be a power of 2, got {rank}")
    runs.check_rank("lora_config.rank", rank, model_cfg.max_lora_rank, req.base_model)
    opt_type = (req.optimizer_config or {}).get("type", "adamw")
    if opt_type != "adamw":
        raise InvalidRequestError(
            f"optimizer_config.type: only 'adamw' is supported, got {opt_type!r}"
        )
    seed = req.lora_config.seed if req.lora_config.seed is not None else 0
    return LoraSpec(
        rank=rank,
        train_attn=req.lora_config.train_attn,
        train_mlp=req.lora_config.train_mlp,
        train_unembed=req.lora_config.train_unembed,
        seed=seed,
    )


async def _add_run(t: RequestContext, run: TrainingRunRow) -> None:
    """Open a new model's run (400 if the id is taken, 403 at a cap)."""
    if t.db.get(TrainingRunRow, run.id) is not None:
        raise InvalidRequestError(f"model_seq_id: model {run.id} already exists in this session")
    await runs.open_run(t, run)
    t.services.held.model_created(run.id)


@router.post("/create_model", **returns(FutureResponse))
async def create_model(req: CreateModelRequest, t: ContextDep) -> dict:
    """Create a LoRA training model in a session; the future resolves to its model id."""
    fp = fingerprint(req.model_dump(mode="json"))
    session = owned_session(t.db, t.who, req.session_id)
    spec = _lora_spec(req, t)
    model_id = f"{session.id}:train:{req.model_seq_id}"

    async def prepare() -> Prepared:
        run = runs.new_run_row(
            model_id, session.id, t.who.user_id, req.base_model, spec, req.user_metadata
        )
        await _add_run(t, run)
        job = jobs.create_adapter_job(req.base_model, model_id, spec, str(t.who.user_id))
        extra = {"base_model": req.base_model, "trace": trace_tag(session.id, model_id)}
        return jobs.runner(t.engine, job), extra

    rec = await submit_once(t, (model_id, 0), fp, "create_model", prepare)
    return future_json(rec, model_id)


@router.post("/get_info", **returns(GetInfoResponse))
async def get_info(req: GetInfoRequest, t: ContextDep) -> dict:
    """A training model's base model, LoRA rank and optimizer."""
    run = owned_run(t.db, t.who, req.model_id, live=True)
    return {
        "type": "get_info",
        "model_id": run.id,
        "model_data": {
            "arch": "lora",
            "model_name": run.base_model,
            "tokenizer_id": run.base_model,
        },
        "model_name": run.base_model,
        "is_lora": True,
        "lora_rank": run.lora_rank,
        "optimizer_config": {"type": "adamw"},
    }


@router.post("/forward", **returns(FutureResponse))  # SDK 0.16.x: forward-only, JSON body
@router.post("/forward_backward", **returns(FutureResponse))
async def forward_backward(request: Request, t: ContextDep) -> dict:
    """Forward (and backward) over a batch in the model's seq_id order; protobuf in and out."""
    body = await train_input.read_body(request, t.config.gateway)
    fp = fingerprint(body)
    msg = train_input.parse(body)
    run = owned_run(t.db, t.who, msg.model_id, live=True)
    seq_id = int(msg.seq_id)
    kind = "forward" if msg.forward_only else "forward_backward"
    # sized on the compact message: a refusal fails this seq_id in order (a 413 for a size)
    planned = train_input.plan(t, run, msg)

    async def prepare() -> Run:
        job_body = body
        if (msg.loss_fn or "cross_entropy") == STABLE_REINFORCE and planned.error is None:
            # the engine gets the recorded logprobs as inputs; a replica taking the job over
            # re-decodes this body, so it carries them too
            provenance.resolve(t.db, run.session_id, msg, t.config.gateway.stability_ttl_seconds)
            check_decoded_size(msg, planned.keep, t.config.gateway.max_decoded_request_mb * 2**20)
            job_body = msg.SerializeToString()
        inp = await train_input.decode(planned)
        model_cfg = t.config.model(run.base_model)
        if model_cfg is not None:  # 413 over the image caps, in order like any bad input
            check_images(
                [
                    (f"data[{i}].model_input.chunks[{p.chunk_index}]", p)
                    for i, d in enumerate(inp.data)
                    for p in d.images
                ],
                model_cfg.images,
            )
        n_tokens = sum(len(d.tokens) + image_token_count(d) for d in inp.data)
        # Over the rate: 429 + retry-after (the SDK resends this seq_id); a request that can
        # never fit is a QuotaExceededError, which fails this seq_id in order.
        await metering.charge_training(t, n_tokens)
        job = jobs.forward_backward_job(run.base_model, run.id, seq_id, job_body, planned.graph)
        return _metered(t, run, jobs.runner(t.engine, job, inp), n_tokens)

    rec = await submit_sequenced(t, run, seq_id, fp, kind, prepare, planned.nbytes)
    return future_json(rec, run.id)


def _metered(
    t: RequestContext, run: TrainingRunRow, job_run: jobs.ReplayableRun, n_tokens: int
) -> Run:
    """``job_run``, recording ``n_tokens`` training tokens in the usage ledger when done."""
    who, ledger = t.who, t.usage

    async def run_() -> tuple[str, object]:
        out = await job_run()
        metering.record_training(ledger, who, run.session_id, run.base_model, n_tokens)
        return out

    return jobs.ReplayableRun(job_run.job, run_)  # a replica taking over re-runs the job


@router.post("/optim_step", **returns(FutureResponse))
async def optim_step(req: OptimStepRequest, t: ContextDep) -> dict:
    """An AdamW step in the model's seq_id order; the future resolves to its metrics."""
    fp = fingerprint(req.model_dump(mode="json"))
    run = owned_run(t.db, t.who, req.model_id, live=True)

    async def prepare() -> Run:
        if req.adam_params is None and req.optimizer_params is not None:
            raise InvalidRequestError("optimizer_params: only AdamW (adam_params) is supported")
        params = AdamParams(**(req.adam_params.model_dump() if req.adam_params else {}))
        return jobs.runner(
            t.engine, jobs.optim_step_job(run.base_model, run.id, req.seq_id, params)
        )

    rec = await submit_sequenced(t, run, req.seq_id, fp, "optim_step", prepare)
    return future_json(rec, run.id)


@router.post("/load_weights", **returns(FutureResponse))
async def load_weights(req: LoadWeightsRequest, t: ContextDep) -> dict:
    """Load a saved training state: into a model in place (sequenced), or as a new model."""
    fp = fingerprint(req.model_dump(mode="json"))
    ckpt = readable_checkpoint(t.db, t.who.user_id, req.path, "path")
    if ckpt.kind != "training":
        raise InvalidRequestError(
            f"path: {req.path} is a {ckpt.kind} checkpoint; load_weights needs a weights/ "
            "checkpoint saved with save_state"
        )
    source = t.db.get(TrainingRunRow, ckpt.run_id)
    if source is None:
        raise NotFoundError(f"path: training run of {req.path} not found")
    if req.model_id is not None:  # legacy in-place load_state, sequenced
        run = owned_run(t.db, t.who, req.model_id, live=True)
        seq_id = req.seq_id or 0

        async def prepare() -> Run:
            return _load_state(t, run.base_model, run.id, seq_id, ckpt.storage_dir, req)

        rec = await submit_sequenced(t, run, seq_id, fp, "load_weights", prepare)
        return future_json(rec, run.id)
    session_id, model_id = _load_target(t, req, source)

    async def prepare_new() -> Prepared:
        await _add_run(
            t,
            TrainingRunRow(
                id=model_id,
                session_id=session_id,
                user_id=t.who.user_id,
                **source.adapter_shape(),
                user_metadata=req.user_metadata or {},
            ),
        )
        run = _load_state(t, source.base_model, model_id, None, ckpt.storage_dir, req)
        return run, {"base_model": source.base_model, "trace": trace_tag(session_id, model_id)}

    rec = await submit_once(t, (model_id, 0), fp, "load_weights", prepare_new)
    return future_json(rec, model_id)


def _load_target(
    t: RequestContext, req: LoadWeightsRequest, source: TrainingRunRow
) -> tuple[str, str]:
    """(session id, model id) of the model a create-via-load makes (400 when it cannot)."""
    if req.session_id is None or req.model_seq_id is None:
        raise InvalidRequestError(
            "session_id, model_seq_id: required to create a model from a checkpoint"
        )
    session = owned_session(t.db, t.who, req.session_id)
    if req.base_model is not None and req.base_model != source.base_model:
        raise InvalidRequestError(
            f"base_model: checkpoint was trained on {source.base_model}, not {req.base_model}"
        )
    if t.config.model(source.base_model) is None:
        raise InvalidRequestError(f"path: base model {source.base_model} is no longer served")
    return session.id, f"{session.id}:train:{req.model_seq_id}"


def _load_state(
    t: RequestContext,
    base: str,
    model_id: str,
    seq_id: int | None,
    directory: str,
    req: LoadWeightsRequest,
) -> Run:
    """The coroutine loading ``directory`` into ``model_id`` (seq_id None: a new model, created by
    the load for this tenant)."""
    engine, tenant = t.engine, str(t.who.user_id)

    async def run_() -> tuple[str, object]:
        await engine.trainer(base).load_state(
            model_id,
            seq_id=seq_id,
            directory=directory,
            include_optimizer=req.optimizer,
            tenant=tenant,  # the owner of a model this load creates (seq_id None)
        )
        return "json", {"path": req.path, "model_id": model_id, "type": "load_weights"}

    return run_
