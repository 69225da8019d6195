"""Encoding for the native data toolkit: ``POST /api/v1/twinkle/encode`` (trajectories → input
features by the base model's own chat template, which the Sampler renders; labels rolled as
upstream's templates roll them), and the helpers the sampler routes (sampler_routes.py) share with
it (`NativeTemplate`: prompts, images, decoding)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from fastapi import APIRouter

from engine.protocol import ImagePart, SamplingParams
from gateway.db.tables import TrainingRunRow
from gateway.deps import ConfigDep, EngineDep, PrincipalDep
from gateway.engine_client import EngineClient, SamplerClient
from gateway.errors import InvalidRequestError, NotFoundError
from gateway.images import data_url_image
from gateway.runs.checkpoints import readable_checkpoint
from gateway.training import sampling as training_sampling
from gateway.twinkle_api.schemas import EncodeRequest, SamplingParamsWire
from gateway.twinkle_api.templates import check_template, checked_images

router = APIRouter(prefix="/api/v1/twinkle")
#: the label of a position that is not trained
IGNORE_INDEX = -100


class NativeTemplate:
    """A native template on one base model: the Sampler renders and tokenizes (the model's own
    chat template, engine/sampler_text.py); this adds the trajectory's images (data: URLs, one
    per image token) and the engine's view of a prompt with images."""

    def __init__(self, sampler: SamplerClient, options: Mapping[str, Any]) -> None:
        self.sampler, self.options = sampler, dict(options)
        self._image_token: list[int | None] = []  # asked once, when a prompt needs it

    async def encode(
        self, item: Mapping[str, Any], *, add_generation_prompt: bool = False, field: str
    ) -> dict[str, Any]:
        """``{"input_ids", "labels", "images"?}`` of one trajectory (labels not rolled)."""
        messages: Any = item.get("messages")  # the engine checks it (a 400 naming the field)
        out: dict[str, Any] = await self.sampler.encode_trajectory(
            messages,
            add_generation_prompt=add_generation_prompt,
            options=self.options,
            field=field,
        )
        images = checked_images(messages, field)
        if images:  # data: URLs, one per image token in input_ids (engine/backends/vision.py)
            out["images"] = images
        return out

    async def prompt_tokens(self, item: Mapping[str, Any], field: str) -> list[int]:
        """Tokens to sample from: an encoded feature's ``input_ids`` as is, or a trajectory with
        the generation prompt appended."""
        if "input_ids" in item:
            ids = item["input_ids"]
            if (
                not isinstance(ids, list)
                or not ids
                or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids)
            ):
                raise InvalidRequestError(f"{field}.input_ids: must be a non-empty list of ints")
            return list(ids)
        if "messages" not in item:
            raise InvalidRequestError(
                f"{field}: expected a trajectory {{'messages': [...]}} or an encoded feature "
                "{'input_ids': [...]}"
            )
        return (await self.encode(item, add_generation_prompt=True, field=field))["input_ids"]

    async def sample_input_parts(
        self, item: Mapping[str, Any], prompt: list[int], field: str
    ) -> tuple[list[int], list[ImagePart]]:
        """The engine's view of ``prompt`` (`prompt_tokens` of ``item``): the text tokens, and
        one `ImagePart` per image token at its place (the item's ``images``, data: URLs, as
        `encode` wrote them); a text prompt comes back as is, with no images."""
        images = item.get("images")
        if images is None and "messages" in item:
            images = checked_images(item["messages"], field)
        images = images or []
        if not self._image_token:
            self._image_token.append(await self.sampler.image_token_id())
        image_id = self._image_token[0]
        marks = [i for i, t in enumerate(prompt) if t == image_id]
        if len(marks) != len(images):
            raise InvalidRequestError(
                f"{field}.images: {len(images)} images for {len(marks)} image tokens in the prompt"
            )
        if not images:
            return prompt, []
        text = [t for t in prompt if t != image_id]
        parts = []
        for k, (pos, ref) in enumerate(zip(marks, images, strict=True)):
            if not isinstance(ref, str):
                raise InvalidRequestError(f"{field}.images[{k}]: must be a data: URL")
            data, fmt = data_url_image(ref, f"{field}.images[{k}]")
            parts.append(ImagePart(data, fmt, pos - k, chunk_index=k))
        return text, parts

    async def decode(self, tokens: list[int]) -> str:
        return await self.sampler.decode(tokens)


def template_for(config, engine: EngineClient, base_model: str, template) -> NativeTemplate:
    """``template`` (a `TemplateSpec`) on ``base_model``: 400 for a model not served here or an
    unknown template name or option."""
    if config.model(base_model) is None:
        raise InvalidRequestError(
            f"base_model: {base_model!r} is not served here; available: "
            f"{[x.name for x in config.models]}"
        )
    check_template(template.name, template.kwargs, "template")
    return NativeTemplate(engine.sampler(base_model), template.kwargs)


@router.post("/encode")
async def encode(
    req: EncodeRequest, who: PrincipalDep, config: ConfigDep, engine: EngineDep
) -> dict:
    enc = template_for(config, engine, req.base_model, req.template)
    feats = []
    for i, item in enumerate(req.inputs):
        f = await enc.encode(
            item, add_generation_prompt=req.add_generation_prompt, field=f"inputs[{i}]"
        )
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
