"""Which model an OpenAI request names, and the model cards GET /v1/models lists.

Owns: resolving ``model`` (a served base model name, a ``tinker://`` / ``twinkle://`` checkpoint
path the caller may read, or ``"<base>;<path>"``) to a base model and adapter directory, and the
cards of the base models and of the sampler checkpoints the caller may use (their own and the
published ones, unexpired; a published card of another user's says ``owned_by: "published"``,
never who).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime

from sqlmodel import col, or_, select

from gateway.db.tables import CheckpointRow, TrainingRunRow, utcnow
from gateway.errors import InvalidRequestError, NotFoundError
from gateway.runs.checkpoints import owner_shown, readable_checkpoint

_SCHEMES = ("tinker://", "twinkle://")


@dataclass(frozen=True)
class Target:
    base_model: str
    adapter_dir: str | None
    #: the session whose run saved the checkpoint, when it is the caller's own: its sampling
    #: usage is billed there. An OpenAI request names no session of its own, so sampling a base
    #: model or someone else's published checkpoint is recorded under no session.
    session_id: str | None = None
    #: the checkpoint's owner as the caller may see it (`owner_shown`); None for a base model
    owner: str | None = None


def _epoch(ts: datetime | None) -> int:
    return 0 if ts is None else int(ts.replace(tzinfo=UTC).timestamp())


def resolve_model(db, who, engine, model: str) -> Target:
    """The base model and adapter directory for ``model``; 404 naming ``model`` if it is neither
    a served base model nor a checkpoint path the caller may read."""
    name = model.strip()
    base_hint = None
    if ";" in name:  # "<base>;<path>"
        base_hint, _, name = (p.strip() for p in name.partition(";"))
        if not name.startswith(_SCHEMES):
            raise InvalidRequestError(
                f"model: {model!r}: after ';' give a tinker:// checkpoint path"
            )
    if name.startswith(_SCHEMES):
        ckpt = readable_checkpoint(db, who.user_id, name, "model")
        run = db.get(TrainingRunRow, ckpt.run_id)
        if run is None or not engine.serves(run.base_model):
            raise NotFoundError(f"model: checkpoint {name} not found")
        if base_hint and base_hint != run.base_model:
            raise InvalidRequestError(
                f"model: checkpoint {name} belongs to base model {run.base_model!r}, "
                f"not {base_hint!r}"
            )
        own = run.session_id if run.user_id == who.user_id else None
        owner = owner_shown(run.user_id, who.user_name, who.user_id)
        return Target(run.base_model, ckpt.storage_dir, own, owner)
    if engine.serves(name):
        return Target(name, None)
    raise NotFoundError(
        f"model: model {model!r} not found; GET /v1/models lists the models you can use"
    )


def model_card(mid: str, created: int, owner: str, base: str | None) -> dict:
    return {
        "id": mid,
        "object": "model",
        "created": created,
        "owned_by": owner,
        "root": base or mid,
        "parent": base,
    }


def checkpoint_models(db, who, engine) -> list[dict]:
    """Cards of the caller's sampler checkpoints and the published ones; another user's card
    names no owner (`owner_shown`)."""
    rows = db.exec(
        select(CheckpointRow, TrainingRunRow.base_model)
        .join(TrainingRunRow, col(TrainingRunRow.id) == CheckpointRow.run_id)
        .where(
            CheckpointRow.kind == "sampler",
            col(CheckpointRow.ephemeral).is_(False),
            or_(CheckpointRow.user_id == who.user_id, col(CheckpointRow.public).is_(True)),
        )
        .order_by(col(CheckpointRow.created_at))
    ).all()
    now = utcnow()
    return [
        model_card(
            row.tinker_path,
            _epoch(row.created_at),
            owner_shown(row.user_id, who.user_name, who.user_id),
            base,
        )
        for row, base in rows
        if (row.expires_at is None or row.expires_at > now) and engine.serves(base)
    ]
