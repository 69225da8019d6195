"""Training runs: opening one under the caller's quotas, and the adapter spec <-> run row.

Owns `spec_of`, `new_run_row`, `check_rank` (the one rank-limit message of the gateway) and
`open_run` / `close_unused_run`. A run is one adapter: a Tinker training client, or one named
adapter of a native model. Every request that makes the Trainer create an adapter (Tinker's
create_model and create-via-load, the native add_adapter_to_model and a load into a new adapter
name) opens its run here first, so the rank and training-client quotas hold on every path.
"""

from __future__ import annotations

from typing import Any

from engine.protocol import LoraSpec
from gateway.context import RequestContext
from gateway.db.tables import TrainingRunRow
from gateway.errors import InvalidRequestError


def spec_of(run: TrainingRunRow) -> LoraSpec:
    """The adapter a run trains."""
    return LoraSpec(
        rank=run.lora_rank,
        train_attn=run.train_attn,
        train_mlp=run.train_mlp,
        train_unembed=run.train_unembed,
        train_vision=run.train_vision,
        seed=run.seed,
    )


def _shape(spec: LoraSpec) -> dict[str, Any]:
    return {
        "lora_rank": spec.rank,
        "train_attn": spec.train_attn,
        "train_mlp": spec.train_mlp,
        "train_unembed": spec.train_unembed,
        "train_vision": spec.train_vision,
        "seed": spec.seed,
    }


def new_run_row(
    run_id: str,
    session_id: str,
    user_id: int,
    base_model: str,
    spec: LoraSpec,
    user_metadata: dict[str, Any] | None = None,
) -> TrainingRunRow:
    return TrainingRunRow(
        id=run_id,
        session_id=session_id,
        user_id=user_id,
        base_model=base_model,
        user_metadata=user_metadata or {},
        **_shape(spec),
    )


def set_spec(run: TrainingRunRow, spec: LoraSpec) -> None:
    for name, value in _shape(spec).items():
        setattr(run, name, value)


def check_rank(field: str, rank: int, max_rank: int, base_model: str) -> None:
    """The served model's own rank limit (a 400 naming ``field``); the caller's quota on the
    rank is `Quotas.check_lora_rank`, in `open_run`."""
    if rank > max_rank:
        raise InvalidRequestError(
            f"{field} {rank} exceeds max LoRA rank {max_rank} for model {base_model}"
        )


async def open_run(ctx: RequestContext, run: TrainingRunRow) -> bool:
    """Take a training-client slot for ``run`` under the caller's quotas (rank: 403; concurrent
    training clients: 403 at the cap, atomic) and write its row: inserted, or (a run re-opened,
    e.g. a native adapter added again) its adapter updated. True when the row is new."""
    limits = ctx.quotas.limits(ctx.who, ctx.db)
    ctx.quotas.check_lora_rank(ctx.who, run.lora_rank, limits)
    await ctx.quotas.acquire_training_client(ctx.who, run.id, limits, ctx.db)
    existing = ctx.db.get(TrainingRunRow, run.id)
    if existing is not None:
        set_spec(existing, spec_of(run))
        run = existing
    ctx.db.add(run)
    ctx.db.commit()
    return existing is None


async def close_unused_run(ctx: RequestContext, run: TrainingRunRow) -> None:
    """Undo `open_run` of a new run whose adapter the engine never created."""
    ctx.db.delete(run)
    ctx.db.commit()
    await ctx.quotas.release_training_clients(ctx.who.user_id, ctx.who.org_id, [run.id])
