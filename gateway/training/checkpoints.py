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

An ephemeral save (Tinker's ``save_weights_for_sampler`` without a name) is under no checkpoint
quota and not billed: it only backs one sampling session and expires after a day. Its bound is
its own: each user keeps at most ``gateway.max_ephemeral_saves`` of them; recording a newer one
deletes the oldest (files, row and the sampling session it backs, which then answers 404), so an
RL loop that saves for its sampler every step keeps working while its disk use stays
``max_ephemeral_saves`` adapters.

A copy (Tinker's ``copy_weights``) is a save whose write is a hard-linked copy of another
checkpoint (`reserve` with the source's size as the estimate): reserved, metered and recorded the
same way.
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
    #: the user's ephemeral saves kept when this one is recorded (`gateway.max_ephemeral_saves`)
    keep_ephemeral: int = 0


async def reserve(
    ctx: RequestContext, run: TrainingRunRow, spec: SaveSpec, estimate: int | None = None
) -> Reservation:
    """Step 1 (see the module docstring). ``estimate``: the save's expected size in bytes
    (default: the size of the run's last checkpoint)."""
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
        if estimate is None:
            last = ctx.db.exec(
                select(CheckpointRow.size_bytes)
                .where(CheckpointRow.run_id == run.id)
                .order_by(col(CheckpointRow.created_at).desc())
            ).first()
            estimate = int(last or 0)
        await ctx.quotas.reserve_checkpoint(ctx.who, parsed.tinker_path, estimate, ctx.db)
    directory = new_storage_dir(ctx.settings.data_dir, ctx.who.user_id, parsed)
    directory.parent.mkdir(parents=True, exist_ok=True)
    expires = None
    if spec.ttl_seconds is not None:
        expires = utcnow() + timedelta(seconds=spec.ttl_seconds)
    keep = ctx.config.gateway.max_ephemeral_saves
    return Reservation(parsed, directory, existing is not None, expires, keep)


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
        gone = []
        if old is not None:
            gone.append(old.storage_dir)
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
            s.merge(  # an ephemeral save for the same sampling session replaces its weights
                SamplingSessionRow(
                    id=spec.sampling_session_id,
                    session_id=run.session_id,
                    user_id=user_id,
                    base_model=run.base_model,
                    model_path=path,
                    adapter_dir=str(res.directory),
                )
            )
        if spec.ephemeral:
            s.flush()
            gone += _prune_ephemeral(s, user_id, res.keep_ephemeral)
        s.commit()
    for directory in gone:  # after the commit: a failed commit leaves every save intact
        shutil.rmtree(directory, ignore_errors=True)


def _prune_ephemeral(s: Session, user_id: int, keep: int) -> list[str]:
    """Delete the user's ephemeral saves beyond the ``keep`` newest (rows and the sampling
    sessions they back); their storage directories, to delete once committed."""
    rows = s.exec(
        select(CheckpointRow)
        .where(CheckpointRow.user_id == user_id, CheckpointRow.ephemeral == True)  # noqa: E712
        .order_by(col(CheckpointRow.created_at).desc(), col(CheckpointRow.id).desc())
        .offset(keep)
    ).all()
    for row in rows:
        backed = select(SamplingSessionRow).where(SamplingSessionRow.model_path == row.tinker_path)
        for sampler in s.exec(backed).all():
            s.delete(sampler)
        s.delete(row)
    return [row.storage_dir for row in rows]
