"""Images for vision-language base models, on the engine side (the gateway never decodes them).

Owns loading a base model of either kind (`load_base_model`: a config with a ``vision_config`` is a
VL model), a VL model's `Vision` (its image processor, loaded explicitly: ``AutoProcessor`` would
silently return only the tokenizer without torchvision; and its image token id), and turning one
datum's inputs into what the model takes:

* Tinker ``ImageChunk``s (`engine.protocol.ImagePart`: encoded bytes at a token position) are
  decoded (declared format checked against the bytes, pixel cap checked before decoding), run
  through the model's own image processor, and replaced by as many image tokens as the processor
  says; a chunk's ``expected_tokens`` must equal that count (the client sized its targets by it);
* upstream Twinkle's pre-processed ``pixel_values`` / ``image_grid_thw`` in ``loss_fn_inputs``
  are checked against the image tokens already in the token list.

Either way the result is the token ids with images expanded plus one `VisionInputs` per datum;
batches concatenate them in row order (`batch_kwargs`), which is how HF's VL models take several
images. Errors are `UserInputError`s naming the field.
"""

from __future__ import annotations

import io
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from engine.errors import UserInputError
from engine.protocol import ImagePart

#: Tinker ImageChunk formats → the PIL format name the bytes must decode as
FORMATS = {"png": "PNG", "jpeg": "JPEG", "jpg": "JPEG"}
#: upstream Twinkle's keys for pre-processed images inside loss_fn_inputs
PREPROCESSED_KEYS = ("pixel_values", "image_grid_thw")


@dataclass
class VisionInputs:
    """One datum's images, processed: ``pixel_values`` float32 [patches, C·T·P·P] and
    ``grid_thw`` int64 [images, 3] (the processor's layout; rows in image order)."""

    pixel_values: np.ndarray
    grid_thw: np.ndarray


def image_from_data_url(ref, where: str) -> tuple[bytes, str]:
    """``(bytes, format)`` of a ``data:image/png|jpeg;base64,...`` URL (how images travel in
    native rows); a `UserInputError` naming ``where`` otherwise."""
    import base64
    import binascii

    if not isinstance(ref, str) or not ref[:5].lower() == "data:":
        raise UserInputError(f"{where}: must be a data:image/png|jpeg;base64,... URL")
    head, _, payload = ref.partition(",")
    media = head[5:].split(";")[0].strip().lower()
    fmt = {"image/png": "png", "image/jpeg": "jpeg", "image/jpg": "jpeg"}.get(media)
    if fmt is None or ";base64" not in head.lower():
        raise UserInputError(f"{where}: must be a base64 data: URL of image/png or image/jpeg")
    try:
        return base64.b64decode(payload, validate=True), fmt
    except (binascii.Error, ValueError):
        raise UserInputError(f"{where}: the image data is not valid base64") from None


def is_vision_model(model_dir: str | Path) -> bool:
    import json

    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    return "vision_config" in cfg


def load_base_model(
    model_dir: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
):
    """The HF model in ``dtype`` on ``device``, eval mode: a causal LM, or an
    image-text-to-text model."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    cls = AutoModelForImageTextToText if is_vision_model(model_dir) else AutoModelForCausalLM
    model = cls.from_pretrained(str(model_dir), dtype=dtype)
    torch.nn.Module.to(model, device)  # in place (transformers' typing of .to confuses pyright)
    return model.eval()


class Vision:
    """A VL model's image handling. ``max_image_pixels`` refuses larger images before decoding."""

    def __init__(self, model_dir: str | Path, config, *, max_image_pixels: int) -> None:
        from transformers import AutoImageProcessor

        self.processor = AutoImageProcessor.from_pretrained(str(model_dir))
        self.image_token_id = int(config.image_token_id)
        self.merge = int(getattr(self.processor, "merge_size", 1) or 1)
        self.max_image_pixels = int(max_image_pixels)

    # -- one image ---------------------------------------------------------------------------
    def decode(self, part: ImagePart, where: str):
        from PIL import Image, UnidentifiedImageError

        fmt = str(part.format).lower()
        if fmt not in FORMATS:
            raise UserInputError(
                f"{where}.format: {part.format!r} is not supported; send png or jpeg"
            )
        try:
            img = Image.open(io.BytesIO(part.data))
        except (UnidentifiedImageError, OSError, ValueError):
            raise UserInputError(f"{where}.data: not a decodable {fmt} image") from None
        if img.format != FORMATS[fmt]:
            raise UserInputError(
                f"{where}.format: declared {fmt!r} but the bytes are {str(img.format).lower()}"
            )
        w, h = img.size
        if w * h > self.max_image_pixels:
            raise UserInputError(
                f"{where}.data: image is {w}x{h} = {w * h} pixels; this server's limit is "
                f"{self.max_image_pixels} (max_image_pixels)"
            )
        try:
            img.load()
        except (OSError, ValueError, Image.DecompressionBombError):
            raise UserInputError(f"{where}.data: truncated or corrupt {fmt} image") from None
        return img.convert("RGB")

    def tokens_for(self, grid_thw: np.ndarray) -> np.ndarray:
        """Image tokens per image: patches / merge² (the model merges merge×merge patches)."""
        return np.prod(grid_thw, axis=-1) // (self.merge**2)

    def process(self, images: list) -> VisionInputs:
        out = self.processor(images=images, return_tensors="np")
        return VisionInputs(
            np.asarray(out["pixel_values"], dtype=np.float32),
            np.asarray(out["image_grid_thw"], dtype=np.int64).reshape(-1, 3),
        )

    # -- one datum ---------------------------------------------------------------------------
    def expand(
        self, tokens: Sequence[int], parts: Sequence[ImagePart], where: str
    ) -> tuple[list[int], VisionInputs]:
        """``tokens`` with each image's tokens inserted at its position; ``where`` names the
        datum's model_input (errors name ``<where>.chunks[i]`` by image order)."""
        images = []
        for k, part in enumerate(parts):
            if not 0 <= part.position <= len(tokens):
                raise UserInputError(f"{where}.images[{k}]: position {part.position} is outside")
            images.append(self.decode(part, f"{where}.chunks[{part.chunk_index}]"))
        vis = self.process(images)
        counts = self.tokens_for(vis.grid_thw)
        out: list[int] = []
        prev = 0
        for part, img, n in zip(parts, images, counts, strict=True):
            if part.expected_tokens is not None and int(part.expected_tokens) != int(n):
                raise UserInputError(
                    f"{where}.chunks[{part.chunk_index}].expected_tokens: {part.expected_tokens}, "
                    f"but this server's image processor makes {int(n)} tokens of this "
                    f"{img.size[0]}x{img.size[1]} image (send {int(n)}, or leave it unset)"
                )
            out += list(tokens[prev : part.position]) + [self.image_token_id] * int(n)
            prev = part.position
        out += list(tokens[prev:])
        return out, vis

    def preprocessed(self, tokens: np.ndarray, pixel_values, grid_thw, where: str) -> VisionInputs:
        """Upstream's ``pixel_values`` / ``image_grid_thw``, checked against the image tokens."""
        try:
            grid = np.asarray(grid_thw, dtype=np.int64).reshape(-1, 3)
            pv = np.asarray(pixel_values, dtype=np.float32)
        except (TypeError, ValueError):
            raise UserInputError(
                f"{where}.image_grid_thw: must be integers [images, 3] and pixel_values numbers"
            ) from None
        patches = int(np.prod(grid, axis=-1).sum())
        if pv.ndim != 2 or pv.shape[0] != patches:
            raise UserInputError(
                f"{where}.pixel_values: shape {list(pv.shape)} must be [{patches}, D]: one row per "
                f"patch of image_grid_thw {grid.tolist()}"
            )
        want = int(self.tokens_for(grid).sum())
        have = int((np.asarray(tokens) == self.image_token_id).sum())
        if have != want:
            raise UserInputError(
                f"{where}.image_grid_thw: {grid.tolist()} makes {want} image tokens, but the "
                f"model_input has {have} (token id {self.image_token_id})"
            )
        return VisionInputs(pv, grid)

    def expand_row(self, row: Mapping, field: str) -> dict:
        """A native row whose ``images`` (data: URLs, one per image token in ``input_ids``, as
        the server's template renders ``<image>``) are processed here: each image token becomes
        the image's tokens (label -100, attention 1) and the row gets ``pixel_values`` /
        ``image_grid_thw`` (the pre-processed form, `preprocessed`)."""
        refs = list(row.get("images") or [])
        ids = [int(t) for t in row["input_ids"]]
        marks = [i for i, t in enumerate(ids) if t == self.image_token_id]
        if len(marks) != len(refs):
            raise UserInputError(
                f"{field}.images: {len(refs)} images for {len(marks)} image tokens "
                f"({self.image_token_id}) in input_ids"
            )
        images = []
        for k, ref in enumerate(refs):
            data, fmt = image_from_data_url(ref, f"{field}.images[{k}]")
            images.append(self.decode(ImagePart(data, fmt, 0), f"{field}.images[{k}]"))
        vis = self.process(images)
        counts = dict(zip(marks, (int(n) for n in self.tokens_for(vis.grid_thw)), strict=True))

        def spread(values, fill):
            out = []
            for i, v in enumerate(values):
                out += [fill if fill is not None else v] * counts[i] if i in counts else [v]
            return out

        new = {k: v for k, v in row.items() if k not in ("images", "position_ids")}
        new["input_ids"] = spread(ids, None)
        if row.get("labels") is not None:
            new["labels"] = spread(list(row["labels"]), -100)
        if row.get("attention_mask") is not None:
            new["attention_mask"] = spread(list(row["attention_mask"]), 1)
        new["pixel_values"], new["image_grid_thw"] = vis.pixel_values, vis.grid_thw
        return new

    # -- a batch -----------------------------------------------------------------------------
    def batch_kwargs(
        self, rows: Sequence[VisionInputs | None], ids: torch.Tensor
    ) -> dict[str, torch.Tensor]:
        """The forward's extra arguments for right-padded ``ids`` whose rows carry ``rows``."""
        present = [r for r in rows if r is not None and r.grid_thw.shape[0]]
        if not present:
            return {}
        device = ids.device
        return {
            "pixel_values": torch.from_numpy(np.concatenate([r.pixel_values for r in present])).to(
                device
            ),
            "image_grid_thw": torch.from_numpy(np.concatenate([r.grid_thw for r in present])).to(
                device
            ),
            "mm_token_type_ids": (ids == self.image_token_id).long(),
        }

    def rope_positions(
        self, model, ids: torch.Tensor, mask: torch.Tensor, extra: dict[str, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """M-RoPE positions [3, B, T] of left-padded ``ids`` with images, and each row's delta
        [B] (a decoded token at index i sits at position i + delta)."""
        positions, delta = model.model.get_rope_index(
            ids,
            extra["mm_token_type_ids"],
            image_grid_thw=extra["image_grid_thw"],
            attention_mask=mask,
        )
        return positions, delta.reshape(-1).to(torch.long)
