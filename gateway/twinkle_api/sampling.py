"""Encoding for the native data toolkit: ``POST /api/v1/twinkle/encode`` (trajectories → input
features with the base model's own tokenizer, labels rolled as upstream's templates roll them),
and the helpers the sampler routes (sampler_routes.py) share with it."""

from __future__ import annotations

import math

from fastapi import APIRouter

from engine.protocol import SamplingParams
from gateway.db.tables import TrainingRunRow
from gateway.deps import ConfigDep, PrincipalDep, SettingsDep
from gateway.errors import InvalidRequestError, NotFoundError
from gateway.runs.checkpoints import readable_checkpoint
from gateway.training import sampling as training_sampling
from gateway.twinkle_api.schemas import EncodeRequest, SamplingParamsWire
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


@router.post("/encode")
async def encode(
    req: EncodeRequest, who: PrincipalDep, config: ConfigDep, settings: SettingsDep
) -> dict:
    enc = encoder_for(config, settings, req.base_model, req.template)
    feats = []
    for i, item in enumerate(req.inputs):
        f = enc.encode(item, add_generation_prompt=req.add_generation_prompt, field=f"inputs[{i}]")
        labels = roll(f["labels"]) if req.label_format == "rolled" else f["labels"]
        row = feature(f["input_ids"], labels)
        if f.get("images"):  # a VL model's images, one per image token (engine expands them)
            row["images"] = f["images"]
        feats.append(row)
    return {"features": feats}


def roll(hf_labels: list[int]) -> list[int]:
    """HF-style labels (``labels[i]`` trains position i, the model shifts) rolled left by one as
    upstream's templates do: ``labels[i]`` becomes the target of ``input_ids[i]``."""
    return [*hf_labels[1:], IGNORE_INDEX] if hf_labels else []


def unroll(rolled: list[int]) -> list[int]:
    return [rolled[-1], *rolled[:-1]] if rolled else []


def feature(input_ids: list[int], labels: list[int]) -> dict:
    """An InputFeature row as upstream's templates write one."""
    n = len(input_ids)
    return {
        "input_ids": input_ids,
        "labels": labels,
        "attention_mask": [1] * n,
        "position_ids": list(range(n)),
        "length": n,
    }


#: a sampling request's max_tokens when it names none (upstream's Tinker handler uses 256 too)
DEFAULT_MAX_TOKENS = 256


def sampling_params(sp: SamplingParamsWire) -> SamplingParams:
    if sp.repetition_penalty != 1.0:
        raise InvalidRequestError(
            f"sampling_params.repetition_penalty: {sp.repetition_penalty} is not served; only "
            "1.0 (off)"
        )
    return training_sampling.sampling_params(
        stop=sp.stop,
        eos="unless_empty_stop",
        max_tokens=sp.max_tokens or DEFAULT_MAX_TOKENS,
        temperature=sp.temperature,
        top_p=sp.top_p,
        top_k=sp.top_k,
        seed=sp.seed,
    )


def adapter_dir_of(db, who, base_model: str, uri: str | None) -> str | None:
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


def finite(x: float) -> float | None:
    return x if math.isfinite(x) else None
