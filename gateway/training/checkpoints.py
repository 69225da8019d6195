"""Saving a checkpoint under the caller's quotas: reserve, write, commit or release, record.

Owns `SaveSpec`, `Reservation`, `reserve`, `write` and `record`, the three steps every dialect's
save goes through:

1. `reserve` (before any work): refuse an existing name without overwrite (400), reserve the
   checkpoint count / bytes quotas of a kept save (403 at a cap; the run's last checkpoint size
   estimates this one's), and make a fresh storage directory;
2. `write`: the dialect's engine call writes the state; a failure releases a fresh reservation,
   a success commits the real size and writes one ``checkpoint`` row to the usage ledger;
3. `record`: the checkpoint row, replacing (row and files) one saved under the same path, and
   the sampling session an ephemeral save backs.

An ephemeral save (Tinker's ``save_weights_for_sampler`` without a name) is under no quota and
not billed: it only backs one sampling session and expires after a day.
"""

from __future__ import annotations

import shutil
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path

from sqlalchemy import Connection, Engine
from sqlmodel import Session, col, select

from gateway.context import RequestContext
from gateway.db.tables import CheckpointRow, SamplingSessionRow, TrainingRunRow, utcnow
from gateway.errors import InvalidRequestError
from gateway.runs.checkpoints import ParsedPath, new_storage_dir


@dataclass(frozen=True)
class SaveSpec:
    """What a save writes: ``kind`` is "training" (weights/), "sampler" or "external"."""

    kind: str
    name: str
    overwrite: bool
    ttl_seconds: int | None
    user_metadata: dict | None
    include_optimizer: bool
    ephemeral: bool = False
    #: an ephemeral save creates this sampling session, and the future answers its id
    sampling_session_id: str | None = None
    #: an export encrypted to these age recipients (gateway/tinker_api/exports.py)
    age_recipients: tuple[str, ...] = ()


@dataclass(frozen=True)
class Reservation:
    """A save accepted before it runs: its path, fresh directory, and whether it replaces one."""

    parsed: ParsedPath
    directory: Path
    replaces: bool
    expires_at: datetime | None


async def reserve(ctx: RequestContext, run: TrainingRunRow, spec: SaveSpec) -> Reservation:
    """Step 1 (see the module docstring)."""
    parsed = ParsedPath(run.id, spec.kind, spec.name)
    existing = ctx.db.exec(
        select(CheckpointRow).where(CheckpointRow.tinker_path == parsed.tinker_path)
    ).first()
    if existing is not None and not spec.overwrite and not spec.ephemeral:
        raise InvalidRequestError(
            f"path: checkpoint {parsed.tinker_path} already exists; "
            "pass overwrite=True to replace it"
        )
    if not spec.ephemeral:
        last = ctx.db.exec(
            select(CheckpointRow.size_bytes)
            .where(CheckpointRow.run_id == run.id)
            .order_by(col(CheckpointRow.created_at).desc())
        ).first()
        await ctx.quotas.reserve_checkpoint(ctx.who, parsed.tinker_path, int(last or 0), ctx.db)
    directory = new_storage_dir(ctx.settings.data_dir, ctx.who.user_id, parsed)
    directory.parent.mkdir(parents=True, exist_ok=True)
    expires = None
    if spec.ttl_seconds is not None:
        expires = utcnow() + timedelta(seconds=spec.ttl_seconds)
    return Reservation(parsed, directory, existing is not None, expires)


async def write(
    ctx: RequestContext,
    run: TrainingRunRow,
    spec: SaveSpec,
    res: Reservation,
    engine_write: Callable[[], Awaitable[int]],
) -> int:
    """Step 2: ``engine_write`` writes the state into ``res.directory`` and returns its size in
    bytes. Uses no DB session of the request (a Tinker save runs in a future, after it)."""
    who, path = ctx.who, res.parsed.tinker_path
    try:
        size = await engine_write()
    except BaseException:
        if not spec.ephemeral and not res.replaces:
            await ctx.quotas.release_checkpoint(who.user_id, who.org_id, path)
        raise
    if not spec.ephemeral:
        await ctx.quotas.commit_checkpoint(who.user_id, who.org_id, path, size)
        ctx.usage.record(
            user_id=who.user_id,
            org_id=who.org_id,
            kind="checkpoint",
            quantity=1,
            session_id=run.session_id,
            base_model=run.base_model,
        )
    return size


def directory_size(directory: Path) -> int:
    return sum(f.stat().st_size for f in directory.rglob("*") if f.is_file())


def record(
    bind: Engine | Connection,
    user_id: int,
    run: TrainingRunRow,
    spec: SaveSpec,
    res: Reservation,
    size: int,
) -> None:
    """Step 3, in its own DB session (a Tinker save's request session is closed by now)."""
    path = res.parsed.tinker_path
    with Session(bind) as s:
        old = s.exec(select(CheckpointRow).where(CheckpointRow.tinker_path == path)).first()
        if old is not None:
            shutil.rmtree(old.storage_dir, ignore_errors=True)
            s.delete(old)
            s.flush()
        s.add(
            CheckpointRow(
                run_id=run.id,
                user_id=user_id,
                kind=spec.kind,
                name=spec.name,
                tinker_path=path,
                storage_dir=str(res.directory),
                size_bytes=size,
                ephemeral=spec.ephemeral,
                user_metadata=spec.user_metadata or {},
                expires_at=res.expires_at,
            )
        )
        if spec.sampling_session_id is not None:
            s.add(
                SamplingSessionRow(
                    id=spec.sampling_session_id,
                    session_id=run.session_id,
                    user_id=user_id,
                    base_model=run.base_model,
                    model_path=path,
                    adapter_dir=str(res.directory),
                )
            )
        s.commit()
