"""Shared test data: random training datums (engine `DatumInput` / `ForwardBackwardInput` and Tinker
`types.Datum`) and random LoRA adapters saved as PEFT checkpoints.

Also generated images (`png`) for the vision-language tests, and a user with an API key
(`create_user_and_key`) for tests that set up a database without the admin API.

Each datum draws its tokens (``length + 1`` ids: inputs and next-token targets) and then, when
``weights`` is a range, its weights from the generator, so a seed gives the same data everywhere.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from engine.protocol import DatumInput, ForwardBackwardInput, LoraSpec

if TYPE_CHECKING:
    from sqlmodel import Session


def _rng(seed_or_rng: int | np.random.Generator) -> np.random.Generator:
    if isinstance(seed_or_rng, np.random.Generator):
        return seed_or_rng
    return np.random.default_rng(seed_or_rng)


def random_datums(
    seed_or_rng: int | np.random.Generator,
    n: int,
    length: int,
    *,
    vocab: tuple[int, int] = (5, 1500),
    weights: tuple[float, float] | None = None,
) -> list[DatumInput]:
    """``n`` engine datums of ``length`` tokens drawn from ``vocab`` (low, high); weights 1, or
    uniform in ``weights`` (low, high)."""
    rng = _rng(seed_or_rng)
    data = []
    for _ in range(n):
        toks = rng.integers(*vocab, size=length + 1)
        w = (
            np.ones(length, np.float32)
            if weights is None
            else rng.uniform(*weights, length).astype(np.float32)
        )
        data.append(
            DatumInput(
                tokens=toks[:-1].tolist(),
                loss_fn_inputs={"target_tokens": toks[1:].astype(np.int64), "weights": w},
            )
        )
    return data


def random_batch(
    seed_or_rng: int | np.random.Generator, n: int = 6, length: int = 12, **kw
) -> ForwardBackwardInput:
    """A cross-entropy `ForwardBackwardInput` of `random_datums`."""
    return ForwardBackwardInput(data=random_datums(seed_or_rng, n, length, **kw))


def random_tinker_datums(
    seed_or_rng: int | np.random.Generator,
    n: int,
    length: int,
    *,
    vocab: tuple[int, int] = (10, 500),
    weights: tuple[float, float] | None = None,
) -> list:
    """``n`` Tinker SDK datums (``types.Datum``), drawn like `random_datums`."""
    from tinker import types

    return [
        types.Datum(
            model_input=types.ModelInput.from_ints(d.tokens),
            loss_fn_inputs={
                "target_tokens": d.loss_fn_inputs["target_tokens"].tolist(),
                "weights": d.loss_fn_inputs["weights"].tolist(),
            },
        )
        for d in random_datums(seed_or_rng, n, length, vocab=vocab, weights=weights)
    ]


def random_adapter(model_dir: Path, out: Path, seed: int, spec: LoraSpec | None = None) -> Path:
    """A LoRA adapter on the model in ``model_dir`` with random B (PEFT initialises B = 0, which
    would leave the output unchanged), saved as a PEFT checkpoint in ``out``. ``spec`` defaults to
    rank 4, alpha 8, seeded with ``seed``."""
    import torch
    from transformers import AutoModelForCausalLM

    from engine.backends.lora import (
        adapter_parameters,
        add_adapter,
        inject_multi_lora,
        save_adapter,
    )

    spec = spec or LoraSpec(rank=4, alpha=8.0, seed=seed)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    inject_multi_lora(model)
    add_adapter(model, "p", spec)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for k, p in adapter_parameters(model, "p").items():
            if "lora_B" in k:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    out.mkdir(parents=True, exist_ok=True)
    save_adapter(model, "p", spec, out)
    return out


def trained_adapter(model_dir: Path, token_ids: list[list[int]], out: Path, steps: int) -> Path:
    """A rank-8 adapter trained by the training backend for ``steps`` AdamW steps
    (lr 5e-3, clip 1.0) on next-token prediction of ``token_ids``, saved (without optimizer) as a
    PEFT checkpoint in ``out``."""
    from engine.backends.train_transformers import TransformersTrainingBackend
    from engine.protocol import AdamParams

    be = TransformersTrainingBackend(str(model_dir))
    be.create_adapter("t", LoraSpec(rank=8, seed=1))
    data = []
    for seq in token_ids:
        ids = np.array(seq)
        data.append(
            DatumInput(
                ids[:-1].tolist(), {"target_tokens": ids[1:], "weights": np.ones(len(ids) - 1)}
            )
        )
    for _ in range(steps):
        be.forward_backward("t", ForwardBackwardInput(data=data))
        be.optim_step("t", AdamParams(learning_rate=5e-3, grad_clip_norm=1.0))
    be.save_state("t", str(out), include_optimizer=False)
    return out


def png(text: str, size: tuple[int, int] = (56, 56), fmt: str = "PNG") -> bytes:
    """A generated OCR-style image: ``text`` drawn black on white, encoded as ``fmt`` (56x56: 4
    image tokens on the tiny VL model)."""
    import io

    from PIL import Image, ImageDraw

    img = Image.new("RGB", size, "white")
    ImageDraw.Draw(img).text((4, size[1] // 3), text, fill="black")
    buf = io.BytesIO()
    img.save(buf, format=fmt)
    return buf.getvalue()


def create_user_and_key(
    session: Session, *, user_name: str, admin: bool, org_name: str | None = None
) -> str:
    """Create user ``user_name`` (in organization ``org_name``, default "default") if missing,
    add a key (scope "admin" if ``admin`` else "user"), and return the plaintext key; this is the
    only time it exists."""
    from gateway.accounts.keys import SCOPE_ADMIN, SCOPE_USER
    from gateway.accounts.service import create_key, ensure_user

    user = ensure_user(session, user_name, org_name=org_name, admin=admin)
    assert user.id is not None
    key, _row = create_key(session, user.id, scope=SCOPE_ADMIN if admin else SCOPE_USER)
    return key


def empty_sparse(cells: int, dtype: int | None = None):
    """A 1 x ``cells`` sparse protobuf tensor with no values (float32 unless ``dtype``): ~40
    bytes on the wire, ``cells`` elements once dense."""
    from gateway.tinker_api.wire_pb import pb

    t = pb.Tensor(dtype=pb.DTYPE_FLOAT32 if dtype is None else dtype, shape=[1, cells])
    t.sparse_csr.crow_indices = np.array([0, 0], np.int64).tobytes()
    return t


def proto_datum(tokens: list[int]):
    """A protobuf datum of ``tokens`` with next-token ``target_tokens`` (each id + 1)."""
    from gateway.tinker_api.wire_pb import pb

    d = pb.Datum()
    d.model_input.add().encoded_text.tokens = np.array(tokens, "<i4").tobytes()
    targets = np.array([t + 1 for t in tokens], np.int64)
    d.loss_fn_inputs["target_tokens"].CopyFrom(
        pb.Tensor(dtype=pb.DTYPE_INT64, dense=targets.tobytes(), shape=[len(tokens)])
    )
    return d
