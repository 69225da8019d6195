"""Native sampling and encoding routes: ``/twinkle/sample``, ``/twinkle/encode``,
``/twinkle/sampler/set_template``.

Served by whichever Sampler the server runs for the base model (torch on CPU; the client's
``vLLMSampler`` and ``TorchSampler`` names both land here). The template is per request (the
client sends the one it set), never global to the sampler. Each input becomes one engine request,
all submitted together so the Sampler batches them; the per-user concurrent-sampling limit of the
Tinker and OpenAI routes applies (429 + retry-after when exceeded).

Each sampled sequence carries ``new_input_feature``: the prompt plus the completion as
``input_ids``, ``labels`` that train only the completion, and ``logprobs`` aligned with
``input_ids`` (0 on the prompt, the sampler's log-probs on the completion), which is what a
GRPO/PPO step trains on after adding ``advantages``.
"""

from __future__ import annotations

import asyncio
import math

from fastapi import APIRouter, Request

from engine.protocol import SampleInput, SamplingParams
from gateway.db.tables import TrainingRunRow
from gateway.deps import ConfigDep, DbDep, EngineDep, PrincipalDep, SettingsDep
from gateway.errors import InvalidRequestError, NotFoundError
from gateway.quotas.concurrency import SamplingLimiterDep
from gateway.quotas.metering import SampleMeter
from gateway.runs.checkpoints import readable_checkpoint
from gateway.twinkle_api.schemas import EncodeRequest, SampleRequest, SetTemplateRequest
from gateway.twinkle_api.templates import IGNORE_INDEX, ChatEncoder, check_template, load_tokenizer

router = APIRouter(prefix="/api/v1/twinkle")


def encoder_for(config, settings, base_model: str, template) -> ChatEncoder:
    m = config.model(base_model)
    if m is None:
        raise InvalidRequestError(
            f"base_model: {base_model!r} is not served here; available: "
            f"{[x.name for x in config.models]}"
        )
    check_template(template.name, template.kwargs, "template")
    model_dir = m.files_dir(settings.data_dir)  # built by the engine (torch-free gateway)
    return ChatEncoder(load_tokenizer(str(model_dir)), template.kwargs)


@router.post("/sampler/set_template")
async def set_template(
    req: SetTemplateRequest, who: PrincipalDep, config: ConfigDep, settings: SettingsDep
) -> dict:
    encoder_for(config, settings, req.base_model, req.template)
    return {"template": req.template.name}


@router.post("/encode")
async def encode(
    req: EncodeRequest, who: PrincipalDep, config: ConfigDep, settings: SettingsDep
) -> dict:
    enc = encoder_for(config, settings, req.base_model, req.template)
    feats = [
        enc.encode(item, add_generation_prompt=req.add_generation_prompt, field=f"inputs[{i}]")
        for i, item in enumerate(req.inputs)
    ]
    return {"features": feats}


def _params(req: SampleRequest) -> SamplingParams:
    sp = req.sampling_params
    strings: list[str] = []
    token_ids: list[int] = []
    if isinstance(sp.stop, str):
        strings = [sp.stop]
    elif sp.stop and isinstance(sp.stop[0], int):
        token_ids = [int(t) for t in sp.stop]
    elif sp.stop:
        strings = [str(s) for s in sp.stop]
    return SamplingParams(
        max_tokens=sp.max_tokens,
        temperature=sp.temperature,
        top_p=sp.top_p,
        top_k=sp.top_k,
        seed=sp.seed,
        stop_strings=strings,
        stop_token_ids=token_ids,
        stop_at_eos=sp.stop is None or bool(sp.stop),
    )


def _adapter_dir(db, who, base_model: str, uri: str | None) -> str | None:
    if not uri:
        return None
    ckpt = readable_checkpoint(db, who.user_id, uri, "adapter_uri")
    run = db.get(TrainingRunRow, ckpt.run_id)
    if run is None:
        raise NotFoundError(f"adapter_uri: {uri} not found")
    if run.base_model != base_model:
        raise InvalidRequestError(
            f"adapter_uri: {uri} was trained on {run.base_model}, not {base_model}"
        )
    return ckpt.storage_dir


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None


@router.post("/sample")
async def sample(
    req: SampleRequest,
    who: PrincipalDep,
    db: DbDep,
    engine: EngineDep,
    config: ConfigDep,
    settings: SettingsDep,
    limiter: SamplingLimiterDep,
    request: Request,
) -> dict:
    enc = encoder_for(config, settings, req.base_model, req.template)
    adapter_dir = _adapter_dir(db, who, req.base_model, req.adapter_uri)
    prompts = [enc.prompt_tokens(item, f"inputs[{i}]") for i, item in enumerate(req.inputs)]
    params = _params(req)
    sp = req.sampling_params
    limits = limiter.quotas.limits(who, db)
    async with limiter.acquire(who, limits):
        # the sample token rate and the usage ledger, as for the Tinker and OpenAI routes
        meter = await SampleMeter.start(
            request.app.state,
            who,
            limits,
            req.base_model,
            sum(len(p) for p in prompts),
            params.max_tokens * sp.num_samples * len(prompts),
        )
        sampled = None
        try:
            outs = await asyncio.gather(
                *(
                    engine.sampler(
                        req.base_model,
                        "sample",
                        SampleInput(
                            prompt_tokens=p,
                            num_samples=sp.num_samples,
                            params=params,
                            prompt_logprobs=sp.prompt_logprobs,
                            adapter_dir=adapter_dir,
                        ),
                        affinity=adapter_dir,
                    )
                    for p in prompts
                )
            )
            sampled = sum(len(s.tokens) for out in outs for s in out.sequences)
        finally:
            await meter.finish(sampled)
    samples = []
    for prompt, out in zip(prompts, outs, strict=True):
        seqs = []
        for s in out.sequences:
            lps = [float(x) for x in s.logprobs]
            seqs.append(
                {
                    "stop_reason": s.stop_reason,
                    "tokens": list(s.tokens),
                    "logprobs": [[[t, lp]] for t, lp in zip(s.tokens, lps, strict=True)],
                    "token_logprobs": lps,
                    "decoded": enc.decode(list(s.tokens)),
                    "new_input_feature": {
                        "input_ids": prompt + list(s.tokens),
                        "labels": [IGNORE_INDEX] * len(prompt) + list(s.tokens),
                        "logprobs": [0.0] * len(prompt) + lps,
                    },
                }
            )
        plp = out.prompt_logprobs
        samples.append(
            {
                "prompt_tokens": prompt,
                "sequences": seqs,
                "prompt_logprobs": [_finite(float(x)) for x in plp] if plp is not None else None,
            }
        )
    return {"samples": samples}
