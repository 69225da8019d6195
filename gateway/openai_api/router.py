"""OpenAI-compatible endpoints: GET /v1/models, POST /v1/chat/completions, POST /v1/completions.

Same API keys as the Tinker API (``Authorization: Bearer tml-…``, what the ``openai`` package
sends). ``model`` is a served base model name or a ``tinker://`` / ``twinkle://`` checkpoint path
the caller may read (their own, or a published one); ``"<base>;<path>"`` is accepted too
(`models` resolves it). The engine's Sampler does the tokenizing (chat template), sampling and
detokenizing; this module maps OpenAI's parameters onto an engine `SampleInput` and renders the
results (`responses`). Each request holds one slot of the caller's concurrent-sampling limit
(`gateway.quotas.concurrency`).

Images (VL models): chat messages may hold ``image_url`` parts whose ``url`` is a
``data:image/png|jpeg;base64,…`` URL (``detail`` is ignored); nothing is ever fetched, so other
URLs are a 400. The gateway only base64-decodes them and checks the caps (`gateway.images`, 413);
the chat template renders each as an ``{"type": "image"}`` part, the Sampler's
`encode_chat_images` gives the text tokens and each image's position, and the engine decodes and
expands the images when it samples (its errors come back naming ``messages[i].content[k]``). An
image counts as one prompt token in metering and ``usage`` (its real token count is known only
inside the engine).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

from fastapi import APIRouter
from fastapi.responses import StreamingResponse

from engine.errors import UserInputError
from engine.protocol import ImagePart, SampleInput, SamplingParams
from gateway.context import ContextDep
from gateway.deps import DbDep, EngineDep, PrincipalDep
from gateway.errors import InvalidRequestError
from gateway.openai_api import responses, streaming
from gateway.openai_api.admission import admitted
from gateway.openai_api.chat_images import (
    ChatImage,
    check_image_caps,
    message_dict,
    rename_image_fields,
)
from gateway.openai_api.models import Target, checkpoint_models, model_card, resolve_model
from gateway.openai_api.schemas import MAX_PROMPTS, ChatCompletionRequest, CompletionRequest
from gateway.runs.checkpoints import PUBLISHED_OWNER
from gateway.training import text_stream
from gateway.training.metering import check_sample_size
from gateway.training.sampling import sampling_params

router = APIRouter(prefix="/v1", tags=["openai"])

#: max_tokens when the client sends none: OpenAI's 16 for /v1/completions; chat has no fixed
#: default at OpenAI (the rest of the context), we use this, clamped to ``max_context_length``
DEFAULT_COMPLETION_MAX_TOKENS = 16
DEFAULT_CHAT_MAX_TOKENS = 256
_SSE_HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}


# ------------------------------------------------------------------------------------- models


@router.get("/models")
async def list_models(who: PrincipalDep, db: DbDep, engine: EngineDep) -> dict:
    bases = [model_card(name, 0, "twinkle", None) for name in engine.base_models]
    return {"object": "list", "data": bases + checkpoint_models(db, who, engine)}


@router.get("/models/{model_id:path}")
async def get_model(model_id: str, who: PrincipalDep, db: DbDep, engine: EngineDep) -> dict:
    target = resolve_model(db, who, engine, model_id)
    if target.adapter_dir is None:
        return model_card(target.base_model, 0, "twinkle", None)
    return model_card(model_id, 0, target.owner or PUBLISHED_OWNER, target.base_model)


# -------------------------------------------------------------------------------- generation


def _params(req, max_tokens: int, stops: list[str]) -> SamplingParams:
    return sampling_params(
        stop=stops,
        eos="always",  # OpenAI always ends at EOS; `stop` only adds strings
        max_tokens=max_tokens,
        temperature=1.0 if req.temperature is None else float(req.temperature),
        top_p=1.0 if req.top_p is None else float(req.top_p),
        top_k=-1 if req.top_k in (None, 0) else int(req.top_k),
        seed=req.seed,
    )


def _max_tokens(explicit: int | None, default: int, prompt_len: int, config, base: str) -> int:
    if explicit is not None:
        return explicit
    ctx = getattr(config.model(base), "max_context_length", None)
    return max(1, min(default, ctx - prompt_len)) if ctx else default


def _as_invalid(
    exc: UserInputError, prompt_field: str, image_fields: Sequence[str] = ()
) -> InvalidRequestError:
    """An engine validation error, with OpenAI's field names instead of the engine's
    (``image_fields[j]``: the message part of image j)."""
    msg = rename_image_fields(str(exc), image_fields)
    msg = msg.replace("sampling_params.", "").replace("num_samples", "n")
    if msg.startswith(("prompt:", "prompt ")):
        msg = prompt_field + msg[len("prompt") :]
    return InvalidRequestError(msg)


def _check_unsupported(req) -> None:
    bad = req.unsupported()
    if bad:
        raise InvalidRequestError(f"{'; '.join(bad)}: not supported by this server")


def _sample_input(
    target: Target,
    prompt: list[int],
    n: int,
    params: SamplingParams,
    images: Sequence[ImagePart] = (),
) -> SampleInput:
    return SampleInput(
        prompt_tokens=prompt,
        num_samples=n,
        params=params,
        adapter_dir=target.adapter_dir,
        prompt_images=list(images),
    )


def _engine_error(exc, field: str, image_fields: Sequence[str] = ()) -> Exception:
    return _as_invalid(exc, field, image_fields) if isinstance(exc, UserInputError) else exc


async def _sample(
    engine,
    target: Target,
    prompt: list[int],
    n: int,
    params: SamplingParams,
    stops: list[str],
    first_index: int,
    prompt_field: str,
    images: Sequence[ImagePart] = (),
    image_fields: Sequence[str] = (),
) -> list[text_stream.Choice]:
    inp = _sample_input(target, prompt, n, params, images)
    return await _run(engine, target, inp, stops, first_index, prompt_field, image_fields)


async def _run(
    engine,
    target: Target,
    inp: SampleInput,
    stops: list[str],
    first_index: int,
    field: str,
    image_fields: Sequence[str] = (),
) -> list[text_stream.Choice]:
    try:
        out = await engine.sampler(target.base_model, affinity=target.adapter_dir).sample(inp)
    except UserInputError as exc:
        raise _as_invalid(exc, field, image_fields) from None
    choices = []
    for j, seq in enumerate(out.sequences):
        pieces = await engine.sampler(target.base_model).decode_pieces(list(seq.tokens))
        lps = list(seq.logprobs)
        choices.append(text_stream.finish(first_index + j, pieces, lps, seq.stop_reason, stops))
    return choices


async def _encode_chat(
    engine, target: Target, messages: list[dict], images: list[ChatImage]
) -> tuple[list[int], list[ImagePart]]:
    """The prompt's text tokens (the Sampler's chat template) and its images placed in them."""
    fields = [img.field for img in images]
    try:
        if not images:
            return await engine.sampler(target.base_model).encode_chat(messages), []
        text, positions = await engine.sampler(target.base_model).encode_chat_images(
            messages, image_fields=fields
        )
    except UserInputError as exc:
        raise _as_invalid(exc, "messages", fields) from None
    parts = [
        ImagePart(img.data, img.format, int(pos), None, chunk_index=j)
        for j, (img, pos) in enumerate(zip(images, positions, strict=True))
    ]
    return text, parts


@router.post("/chat/completions")
async def chat_completions(
    req: ChatCompletionRequest,
    ctx: ContextDep,
):
    """A chat completion (or its SSE stream) from a base model or one of your checkpoints."""
    who, db, engine, config = ctx.who, ctx.db, ctx.engine, ctx.config
    _check_unsupported(req)
    stops = req.stop_strings()
    converted = [message_dict(i, m) for i, m in enumerate(req.messages)]
    messages = [msg for msg, _ in converted]
    images = [img for _, imgs in converted for img in imgs]
    target = resolve_model(db, who, engine, req.model)
    if images:
        check_image_caps(config.model(target.base_model), images)
    fields = [img.field for img in images]
    async with admitted(ctx, target.session_id) as adm:
        prompt, parts = await _encode_chat(engine, target, messages, images)
        n_prompt = len(prompt) + len(parts)  # an image counts as one token (module docstring)
        explicit = req.max_completion_tokens or req.max_tokens
        max_tokens = _max_tokens(
            explicit, DEFAULT_CHAT_MAX_TOKENS, n_prompt, config, target.base_model
        )
        params = _params(req, max_tokens, stops)
        await adm.meter(target.base_model, n_prompt, max_tokens * req.n, req.n)
        rid, created, logprobs = responses.new_id("chatcmpl"), responses.now(), bool(req.logprobs)
        if req.stream:
            events = await text_stream.open_stream(
                text_stream.sample_events(
                    engine,
                    target.base_model,
                    _sample_input(target, prompt, req.n, params, parts),
                    stops,
                    0,
                ),
                lambda exc: _engine_error(exc, "messages", fields),
            )
            usage = bool(req.stream_options and req.stream_options.include_usage)
            return _sse(
                streaming.chat_sse(
                    rid, req.model, created, req.n, events, n_prompt, logprobs, usage, adm.finish
                )
            )
        choices = await _sample(
            engine, target, prompt, req.n, params, stops, 0, "messages", parts, fields
        )
    await adm.finish(choices)
    return responses.chat_completion(rid, req.model, created, choices, n_prompt, logprobs)


def _prompts(req: CompletionRequest) -> list[str | list[int]]:
    p = req.prompt
    if isinstance(p, str):
        return [p]
    if not p:
        raise InvalidRequestError("prompt: must not be empty")
    # pydantic validated p as one of list[str] | list[int] | list[list[int]], never a mix
    if all(isinstance(x, int) for x in p):
        return [cast("list[int]", list(p))]  # one prompt given as token ids
    if len(p) > MAX_PROMPTS:
        raise InvalidRequestError(f"prompt: at most {MAX_PROMPTS} prompts per request")
    return cast("list[str | list[int]]", list(p))


@router.post("/completions")
async def completions(
    req: CompletionRequest,
    ctx: ContextDep,
):
    """Text completions (or their SSE stream) of one or more prompts, text or token ids."""
    who, db, engine, config = ctx.who, ctx.db, ctx.engine, ctx.config
    _check_unsupported(req)
    stops = req.stop_strings()
    prompts = _prompts(req)
    target = resolve_model(db, who, engine, req.model)
    rid, created = responses.new_id("cmpl"), responses.now()
    logprobs = req.logprobs is not None
    check_sample_size(config.gateway, "n", len(prompts) * req.n)  # before any prompt is encoded
    async with admitted(ctx, target.session_id) as adm:
        inputs, prompt_tokens, budget = await _completion_inputs(
            req, prompts, engine, target, config, stops
        )
        await adm.meter(target.base_model, prompt_tokens, budget, len(prompts) * req.n)
        if req.stream:
            usage = bool(req.stream_options and req.stream_options.include_usage)
            events = await text_stream.open_stream(
                _chain_events(engine, target, inputs, stops, req.n),
                lambda exc: _engine_error(exc, inputs[0][0]),
            )
            return _sse(
                streaming.completion_sse(
                    rid, req.model, created, events, prompt_tokens, logprobs, usage, adm.finish
                )
            )
        choices: list[text_stream.Choice] = []
        for k, (field, inp) in enumerate(inputs):
            choices += await _run(engine, target, inp, stops, k * req.n, field)
    await adm.finish(choices)
    return responses.completion(rid, req.model, created, choices, prompt_tokens, logprobs)


async def _completion_inputs(
    req: CompletionRequest,
    prompts: list[str | list[int]],
    engine,
    target: Target,
    config,
    stops: list[str],
) -> tuple[list[tuple[str, SampleInput]], int, int]:
    """One engine input per prompt (tokenized by the Sampler), with the field name its errors
    name, plus the prompt tokens and the sampled-token budget to meter."""
    inputs: list[tuple[str, SampleInput]] = []
    prompt_tokens = budget = 0
    for k, p in enumerate(prompts):
        field = "prompt" if len(prompts) == 1 else f"prompt[{k}]"
        try:
            tokens = (
                await engine.sampler(target.base_model).encode_text(p) if isinstance(p, str) else p
            )
        except UserInputError as exc:
            raise _as_invalid(exc, field) from None
        if not tokens:
            raise InvalidRequestError(f"{field}: must contain at least one token")
        prompt_tokens += len(tokens)
        max_tokens = _max_tokens(
            req.max_tokens, DEFAULT_COMPLETION_MAX_TOKENS, len(tokens), config, target.base_model
        )
        budget += max_tokens * req.n
        params = _params(req, max_tokens, stops)
        inputs.append((field, _sample_input(target, tokens, req.n, params)))
    return inputs, prompt_tokens, budget


def _sse(stream) -> StreamingResponse:
    return StreamingResponse(stream, media_type="text/event-stream", headers=_SSE_HEADERS)


async def _chain_events(engine, target: Target, inputs, stops: list[str], n: int):
    """The prompts of one /v1/completions request, streamed one after another."""
    for k, (_field, inp) in enumerate(inputs):
        async for ev in text_stream.sample_events(engine, target.base_model, inp, stops, k * n):
            yield ev
