"""Upstream Twinkle's native sampler protocol (twinkle-kit 0.5.1's ``vLLMSampler``):
``POST /api/v1/sampler/<base_model>/twinkle/{create, set_template, sample, sample_stream,
add_adapter_to_sampler, apply_patch}``.

Served by whichever Sampler the server runs for the base model (torch on CPU, vLLM on GPU: the
client's class name does not choose). The template is the caller's session's own (upstream's is
global to the sampler, so one tenant's set_template changed everyone's), kept in the shared KV
store so every gateway replica sees it. Each input becomes one engine request, all submitted
together so the Sampler batches them; the per-user concurrent-sampling limit and the sample-token
rate of the Tinker and OpenAI routes apply (429 + retry-after when exceeded). An adapter is named
by ``adapter_uri``, a ``twinkle://`` (or ``tinker://``) checkpoint the caller may read; anything
else is a 4xx, never a silent fall back to the base model.

Each sampled sequence carries ``new_input_feature``: the input row with the completion appended
(``input_ids``; ``labels`` rolled, training only the completion; ``attention_mask``,
``position_ids``, ``length``; ``messages`` + the assistant's reply), ready for forward_backward.
"""

from __future__ import annotations

import asyncio
import copy
import json
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Annotated, Any

from fastapi import APIRouter, Body
from fastapi.responses import StreamingResponse

from engine.errors import EngineError
from engine.protocol import SampleInput, SampleOutput
from gateway.context import ContextDep, RequestContext
from gateway.deps import PrincipalDep
from gateway.errors import InvalidRequestError, NotImplementedOnServerError
from gateway.images import check_images
from gateway.training import metering, text_stream
from gateway.training.metering import check_sample_size
from gateway.twinkle_api.native_deps import BaseModelDep, NativeSessionDep
from gateway.twinkle_api.sampling import (
    IGNORE_INDEX,
    adapter_dir_of,
    feature,
    finite,
    roll,
    sampling_params,
    template_for,
    unroll,
)
from gateway.twinkle_api.schemas import (
    SampleRequest,
    SamplerTemplateRequest,
    SamplingParamsWire,
    TemplateSpec,
)
from gateway.twinkle_api.templates import check_template

router = APIRouter(prefix="/api/v1/sampler")
#: a session's sampler template lives as long as a native model record (model_registry.py)
TEMPLATE_TTL_S = 7 * 24 * 3600.0


def _template_key(session_id: str, base_model: str) -> str:
    return f"native-sampler-template:{session_id}:{base_model}"


async def _template(ctx: RequestContext, session_id: str, base_model: str) -> TemplateSpec:
    raw = await ctx.kv.get(_template_key(session_id, base_model))
    return TemplateSpec(**json.loads(raw)) if raw is not None else TemplateSpec()


@router.post("/{base_model:path}/twinkle/create")
async def create(
    name: BaseModelDep,
    session: NativeSessionDep,
    body: Annotated[dict[str, Any] | None, Body()] = None,
) -> dict:
    """Nothing to host: the Sampler serves every session; this checks the model and session."""
    return {"status": "ok", "base_model": name}


@router.post("/{base_model:path}/twinkle/set_template")
async def set_template(
    name: BaseModelDep,
    session: NativeSessionDep,
    req: SamplerTemplateRequest,
    ctx: ContextDep,
) -> dict:
    spec = TemplateSpec(name=req.template_cls, kwargs=dict(req.model_extra or {}))
    check_template(spec.name, spec.kwargs, "template_cls")
    template = template_for(ctx.config, ctx.engine, name, spec)
    # the model's template renders a conversation with these options (else a 400 now, not later)
    await template.encode({"messages": [{"role": "user", "content": "hi"}]}, field="template_cls")
    payload = json.dumps(spec.model_dump()).encode()
    await ctx.kv.set(_template_key(session.id, name), payload, TEMPLATE_TTL_S)
    return {"status": "ok"}


def _new_feature(row: dict[str, Any], prompt: list[int], tokens: list[int], text: str) -> dict:
    """upstream's ``Template.concat_input_feature``: the row plus the completion."""
    out = copy.deepcopy(row)
    labels = row.get("labels")
    hf = unroll(list(labels)) if isinstance(labels, list) and len(labels) == len(prompt) else []
    hf = hf or [IGNORE_INDEX] * len(prompt)
    out.update(feature(prompt + tokens, roll(hf + tokens)))
    if isinstance(row.get("messages"), list):
        out["messages"] = [*row["messages"], {"role": "assistant", "content": text}]
    return out


def _inputs(req: SampleRequest) -> list[dict[str, Any]]:
    inputs = req.inputs if isinstance(req.inputs, list) else [req.inputs]
    if not inputs or len(inputs) > 256:
        raise InvalidRequestError("inputs: 1 to 256 trajectories or input features")
    return inputs


def _request_parts(req: SampleRequest, db, who, base: str):
    sp = req.sampling_params or SamplingParamsWire()
    if req.adapter_name and not req.adapter_uri:
        raise InvalidRequestError(
            f"adapter_name: {req.adapter_name!r} names no adapter of the sampler here; pass "
            "adapter_uri=<twinkle:// path from model.save(..., is_sampler=True)>"
        )
    n = sp.num_samples or req.num_samples
    return sp, sampling_params(sp), n, adapter_dir_of(db, who, base, req.adapter_uri)


async def _prepare(ctx: RequestContext, name: str, session_id: str, req: SampleRequest):
    """The encoder, inputs, prompts (and their engine parts, images checked against the caps)
    and sampling parameters of a sample request."""
    enc = template_for(ctx.config, ctx.engine, name, await _template(ctx, session_id, name))
    inputs = _inputs(req)
    sp, params, n, adapter_dir = _request_parts(req, ctx.db, ctx.who, name)
    # before any prompt is rendered: a request of 256 inputs x 64 samples is refused unread
    check_sample_size(ctx.config.gateway, "inputs x num_samples", len(inputs) * n)
    prompts = [await enc.prompt_tokens(item, f"inputs[{i}]") for i, item in enumerate(inputs)]
    # the engine's view: text tokens and the images at their places (VL models)
    engine_prompts = [
        await enc.sample_input_parts(item, p, f"inputs[{i}]")
        for i, (item, p) in enumerate(zip(inputs, prompts, strict=True))
    ]
    model_cfg = ctx.config.model(name)
    if model_cfg is not None:
        check_images(
            [(f"inputs[{i}].images[{k}]", part) for i, (_, ps) in enumerate(engine_prompts)
             for k, part in enumerate(ps)],
            model_cfg.images,
        )  # fmt: skip
    return enc, inputs, prompts, engine_prompts, sp, params, n, adapter_dir


@router.post("/{base_model:path}/twinkle/sample")
async def sample(
    name: BaseModelDep, session: NativeSessionDep, req: SampleRequest, ctx: ContextDep
) -> dict:
    enc, inputs, prompts, engine_prompts, sp, params, n, adapter_dir = await _prepare(
        ctx, name, session.id, req
    )
    base = SampleInput(
        prompt_tokens=[],
        num_samples=n,
        params=params,
        prompt_logprobs=bool(sp.prompt_logprobs),
        adapter_dir=adapter_dir,
    )
    # the sample token rate, the concurrent-sampling slot and the usage ledger, as for the
    # Tinker and OpenAI routes; usage goes to the session of the client's sampler
    async with metering.admitted(ctx, session.id) as adm:
        await adm.meter(
            name,
            sum(map(len, prompts)),
            params.max_tokens * n * len(prompts),
            n * len(prompts),
            "inputs x num_samples",
        )
        sampler = ctx.engine.sampler(name, affinity=adapter_dir)
        outs = await asyncio.gather(
            *(
                sampler.sample(replace(base, prompt_tokens=p, prompt_images=parts))
                for p, parts in engine_prompts
            )
        )
        await adm.finish(sum(len(s.tokens) for out in outs for s in out.sequences))
    return {
        "samples": [
            await _sample_json(enc, row, prompt, out)
            for row, prompt, out in zip(inputs, prompts, outs, strict=True)
        ]
    }


async def _sample_json(enc, row: dict[str, Any], prompt: list[int], out: SampleOutput) -> dict:
    """One input's samples in upstream's ``SampleResponse`` shape."""
    seqs = []
    for s in out.sequences:
        toks, lps = list(s.tokens), [float(x) for x in s.logprobs]
        text = await enc.decode(toks)
        seqs.append(
            {
                "stop_reason": s.stop_reason,
                "tokens": toks,
                "logprobs": [[[t, lp]] for t, lp in zip(toks, lps, strict=True)],
                "decoded": text,
                "new_input_feature": _new_feature(row, prompt, toks, text),
            }
        )
    plp = out.prompt_logprobs
    return {
        "prompt_tokens": prompt,  # ours, beyond upstream's fields
        "sequences": seqs,
        "prompt_logprobs": [finite(float(x)) for x in plp] if plp is not None else None,
        "topk_prompt_logprobs": None,
    }


@router.post("/{base_model:path}/twinkle/sample_stream")
async def sample_stream(
    name: BaseModelDep, session: NativeSessionDep, req: SampleRequest, ctx: ContextDep
) -> StreamingResponse:
    """One input, one sample, streamed as NDJSON lines ``{"delta", "finish_reason"}`` while the
    engine generates (upstream's shape); the last line has the finish reason."""
    enc = template_for(ctx.config, ctx.engine, name, await _template(ctx, session.id, name))
    inputs = _inputs(req)
    sp, params, n, adapter_dir = _request_parts(req, ctx.db, ctx.who, name)
    if len(inputs) != 1 or n != 1:
        raise InvalidRequestError("inputs: sample_stream takes one input and num_samples 1")
    prompt = await enc.prompt_tokens(inputs[0], "inputs[0]")
    async with metering.admitted(ctx, session.id) as adm:
        await adm.meter(name, len(prompt), params.max_tokens)
        text, parts = await enc.sample_input_parts(inputs[0], prompt, "inputs[0]")
        inp = SampleInput(
            prompt_tokens=text,
            prompt_images=parts,
            num_samples=1,
            params=params,
            adapter_dir=adapter_dir,
        )
        events = await text_stream.open_stream(
            text_stream.sample_events(ctx.engine, name, inp, params.stop_strings, 0),
            lambda exc: InvalidRequestError(f"inputs[0]: {exc}"),
        )
    return StreamingResponse(_ndjson_lines(events, adm), media_type="application/x-ndjson")


async def _ndjson_lines(
    events: AsyncIterator[text_stream.TextEvent | text_stream.FinishEvent],
    adm: metering.SampleAdmission,
) -> AsyncIterator[bytes]:
    """The stream's NDJSON lines; the sampled tokens are metered once it ends, however it ends."""
    sampled = 0
    try:
        async for ev in events:
            if isinstance(ev, text_stream.TextEvent):
                sampled += len(ev.pieces)
                yield (json.dumps({"delta": ev.text, "finish_reason": None}) + "\n").encode()
            else:  # the remaining text came as a TextEvent just before
                sampled = ev.choice.n_tokens
                line = {"delta": "", "finish_reason": ev.choice.finish_reason}
                yield (json.dumps(line) + "\n").encode()
    except EngineError as exc:
        yield (json.dumps({"error": str(exc)}) + "\n").encode()
    finally:
        await adm.finish(sampled)


@router.post("/{base_model:path}/twinkle/{method}")
async def unavailable(name: BaseModelDep, method: str, who: PrincipalDep) -> dict:
    if method == "add_adapter_to_sampler":
        raise NotImplementedOnServerError(
            "add_adapter_to_sampler: not available on this server: the sampler loads adapters "
            "from checkpoints; pass adapter_uri=<twinkle:// path of model.save(..., "
            "is_sampler=True)> to sample"
        )
    if method == "apply_patch":
        raise NotImplementedOnServerError("apply_patch: no sampler patches are available here")
    raise InvalidRequestError(
        f"method: {method!r} is not a sampler method; available: create, set_template, sample, "
        "sample_stream"
    )
