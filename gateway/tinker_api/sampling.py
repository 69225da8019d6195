"""Tinker sampling endpoints: create_sampling_session, samplers/{id}, asample."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter

from engine.protocol import ImagePart, SampleInput, SamplingParams
from gateway.context import ContextDep, RequestContext
from gateway.db.tables import SamplingSessionRow, TrainingRunRow
from gateway.deps import ConfigDep, DbDep, PrincipalDep, owned_sampler, owned_session
from gateway.errors import InvalidRequestError, NotFoundError
from gateway.futures.store import fingerprint
from gateway.images import check_images, json_image_chunk
from gateway.runs import stability_records as stability
from gateway.runs.checkpoints import readable_checkpoint
from gateway.runs.request_log import trace_tag
from gateway.tinker_api.proto_codec import encode_sample_output, target_ids_from_wire
from gateway.tinker_api.schemas import (
    CreateSamplingSessionRequest,
    CreateSamplingSessionResponse,
    GetSamplerResponse,
    SampleFutureResponse,
    SampleRequest,
    returns,
)
from gateway.tinker_api.sequenced import Prepared, Run, submit_once
from gateway.training import metering
from gateway.training.sampling import sampling_params
from gateway.training.sessions import check_sampling_room

router = APIRouter(prefix="/api/v1")
DEFAULT_MAX_TOKENS = 128


def _resolve_target(db, who, config, base_model: str | None, model_path: str | None):
    """(base_model, adapter_dir, model_path) for a base model name or a readable checkpoint path."""
    if model_path:
        ckpt = readable_checkpoint(db, who.user_id, model_path, "model_path")
        run = db.get(TrainingRunRow, ckpt.run_id)
        if run is None:
            raise NotFoundError(f"model_path: {model_path} not found")
        return run.base_model, ckpt.storage_dir, model_path
    if not base_model:
        raise InvalidRequestError("base_model or model_path: one is required")
    if config.model(base_model) is None:
        raise InvalidRequestError(
            f"base_model: {base_model!r} is not served here; available: "
            f"{[m.name for m in config.models]}"
        )
    return base_model, None, None


def _session_target(t: RequestContext, row: SamplingSessionRow) -> tuple[str, str]:
    """(base model, adapter dir) of a sampling session on a checkpoint, checked on every request:
    the checkpoint must still be readable by the caller (another user's must still be
    published; none may have expired or been deleted), else 404 naming the session."""
    try:
        base, adapter_dir, _ = _resolve_target(t.db, t.who, t.config, None, row.model_path)
    except NotFoundError:
        raise NotFoundError(
            f"sampling_session_id: {row.id} samples {row.model_path}, which you can no longer "
            "read (deleted, unpublished by its owner, expired, or an ephemeral save replaced by "
            "newer ones); create a sampling session on a checkpoint you can read"
        ) from None
    assert adapter_dir is not None  # a model_path always resolves to a checkpoint's directory
    return base, adapter_dir


@router.post("/create_sampling_session", **returns(CreateSamplingSessionResponse))
async def create_sampling_session(
    req: CreateSamplingSessionRequest, who: PrincipalDep, db: DbDep, config: ConfigDep
) -> dict:
    """Open a sampling session on a base model or a saved checkpoint path."""
    session = owned_session(db, who, req.session_id)
    base, adapter_dir, path = _resolve_target(db, who, config, req.base_model, req.model_path)
    sampler_id = f"{session.id}:sample:{req.sampling_session_seq_id}"
    if db.get(SamplingSessionRow, sampler_id) is None:
        check_sampling_room(db, session, config)
        db.add(
            SamplingSessionRow(
                id=sampler_id,
                session_id=session.id,
                user_id=who.user_id,
                base_model=base,
                model_path=path,
                adapter_dir=adapter_dir,
            )
        )
        db.commit()
    return {"sampling_session_id": sampler_id, "type": "create_sampling_session"}


@router.get("/samplers/{sampler_id}", **returns(GetSamplerResponse))
async def get_sampler(sampler_id: str, who: PrincipalDep, db: DbDep) -> dict:
    """A sampling session's base model and checkpoint path."""
    row = owned_sampler(db, who, sampler_id)
    return {"sampler_id": row.id, "base_model": row.base_model, "model_path": row.model_path}


def _sampling_params(req: SampleRequest) -> SamplingParams:
    sp = req.sampling_params
    return sampling_params(
        stop=sp.stop,
        eos="unless_stop",
        max_tokens=sp.max_tokens or DEFAULT_MAX_TOKENS,
        temperature=sp.temperature,
        top_p=sp.top_p,
        top_k=sp.top_k,
        seed=sp.seed,
    )


def _prompt(req: SampleRequest) -> tuple[list[int], list[ImagePart]]:
    """The prompt's text tokens and its images (JSON image chunks: base64 ``data``)."""
    tokens: list[int] = []
    images: list[ImagePart] = []
    for i, chunk in enumerate(req.prompt.chunks):
        kind = chunk.get("type", "encoded_text")
        if kind == "image":
            data, fmt, expected = json_image_chunk(chunk, f"prompt.chunks[{i}]")
            images.append(ImagePart(data, fmt, len(tokens), expected, chunk_index=i))
            continue
        if kind != "encoded_text":
            raise InvalidRequestError(
                f"prompt.chunks[{i}].type: {kind!r} chunks are not supported (encoded_text and "
                "image are; this server fetches nothing, so image_asset_pointer is refused)"
            )
        toks = chunk.get("tokens")
        if not isinstance(toks, list) or not all(isinstance(t, int) for t in toks):
            raise InvalidRequestError(f"prompt.chunks[{i}].tokens: must be a list of integers")
        tokens.extend(toks)
    if not tokens and not images:
        raise InvalidRequestError("prompt: must contain at least one token")
    return tokens, images


@router.post("/asample", **returns(SampleFutureResponse))
async def asample(req: SampleRequest, t: ContextDep) -> dict:
    """Sample from a sampling session (or a base model / checkpoint path); protobuf result."""
    trace, row = None, None
    if req.sampling_session_id:
        row = owned_sampler(t.db, t.who, req.sampling_session_id)
        trace = trace_tag(row.session_id, row.id)
        base, adapter_dir = row.base_model, None
        if row.model_path:
            base, adapter_dir = _session_target(t, row)
        idem = (row.id, req.seq_id) if req.seq_id is not None else None
    else:
        base, adapter_dir, _ = _resolve_target(
            t.db, t.who, t.config, req.base_model, req.model_path
        )
        idem = None
    fp = fingerprint(req.model_dump(mode="json"))

    if req.record_stability_info and row is None:
        raise InvalidRequestError(
            "record_stability_info: needs a sampling_session_id (records belong to the client "
            "session of a sampling client)"
        )

    async def prepare() -> Prepared:
        ids = stability.new_sequence_ids(req.num_samples)
        keep = (row.session_id, ids) if req.record_stability_info and row is not None else None
        run = await _sample_run(t, req, base, adapter_dir, keep)
        return run, {"sequence_ids": ids, "trace": trace}

    # a retry of the same seq_id gets the first future, with its sequence ids
    rec = await submit_once(t, idem, fp, "sample", prepare)
    return {"request_id": rec.request_id, "sample_sequence_ids": rec.extra["sequence_ids"]}


async def _sample_run(
    t: RequestContext,
    req: SampleRequest,
    base: str,
    adapter_dir: str | None,
    keep: tuple[str, list[str]] | None = None,
) -> Run:
    """Charge the token rate and take a sampling slot; the coroutine samples, records usage (and,
    with ``keep`` = (client session, sequence ids), each sequence's stability info), and gives
    back the slot and the unused tokens."""
    target_ids, target_csr = None, None
    if req.target_prompt_logprobs is not None:
        target_ids, target_csr = target_ids_from_wire(req.target_prompt_logprobs)
    tokens, images = _prompt(req)
    model_cfg = t.config.model(base)
    if images and model_cfg is not None:
        check_images([(f"prompt.chunks[{p.chunk_index}]", p) for p in images], model_cfg.images)
    inp = SampleInput(
        prompt_tokens=tokens,
        prompt_images=images,
        num_samples=req.num_samples,
        params=_sampling_params(req),
        prompt_logprobs=req.prompt_logprobs,
        adapter_dir=adapter_dir,
        topk_prompt_logprobs=req.topk_prompt_logprobs,
        topk_sample_logprobs=req.topk_sample_logprobs,
        prompt_logprobs_last_n=req.prompt_logprobs_last_n,
        prompt_alt_tokens_k=req.prompt_alt_tokens_k,
        target_prompt_ids=target_ids,
    )
    # One slot of the concurrent-sampling limit from submit until the future finishes, and the
    # token rate: prompt + the most it may sample charged up front, the unused part refunded.
    # Over either: 429 + retry-after, no future is recorded, the SDK retries.
    n_prompt = len(inp.prompt_tokens) + sum(p.expected_tokens or 1 for p in images)
    # the sampling session's client session (a sampler id is "<session>:sample:<n>")
    session_id = req.sampling_session_id.split(":")[0] if req.sampling_session_id else None
    async with metering.admitted(t, session_id) as adm:
        await adm.meter(base, n_prompt, inp.params.max_tokens * inp.num_samples, inp.num_samples)
    engine, bind = t.engine, t.services.db_engine
    # a sampling session sticks to one Sampler replica (its adapter stays cached there)
    affinity = req.sampling_session_id or adapter_dir

    async def run_() -> tuple[str, object]:
        sampled = None
        try:
            out = await engine.sampler(base, affinity=affinity).sample(inp)
            sampled = sum(len(s.tokens) for s in out.sequences)
            if keep is not None:
                gw = t.config.gateway
                await asyncio.to_thread(
                    stability.record,
                    bind,
                    *keep,
                    inp.prompt_tokens,
                    out,
                    gw.stability_ttl_seconds,
                    gw.max_stability_records_per_session,
                )
            return "proto", encode_sample_output(out, target_csr)
        finally:
            await adm.finish(sampled)

    return run_
