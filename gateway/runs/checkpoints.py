"""Checkpoint paths and storage: parsing `tinker://` / `twinkle://` paths, validating names, where
files live, and who may read them.

Paths are `tinker://<run_id>/<kind>/<name>` with kind in weights | sampler_weights |
external_weights (exactly three parts, so neither run id nor name contains `/`). `twinkle://` is an
alias. Files live under `<data_dir>/checkpoints/<user_id>/`; the server-side directory is never
sent to clients.
"""

from __future__ import annotations

import re
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path

from sqlmodel import Session, select

from gateway.db.tables import CheckpointRow, utcnow
from gateway.errors import InvalidRequestError, NotFoundError

KIND_SEGMENTS = {
    "weights": "training",
    "sampler_weights": "sampler",
    "external_weights": "external",
}
SEGMENT_OF_KIND = {v: k for k, v in KIND_SEGMENTS.items()}
#: used with ``fullmatch``: ``$`` would accept a name ending in a newline
_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_SCHEMES = ("tinker://", "twinkle://")
#: who a caller is told owns another user's published run or checkpoint: publishing shares the
#: weights, not the owner's identity (name or id)
PUBLISHED_OWNER = "published"


def owner_shown(owner_id: int, owner_name: str, viewer_id: int) -> str:
    """The owner as ``viewer_id`` may see it: their own name, else `PUBLISHED_OWNER`."""
    return owner_name if owner_id == viewer_id else PUBLISHED_OWNER


@dataclass(frozen=True)
class ParsedPath:
    run_id: str
    kind: str  # training | sampler | external
    name: str

    @property
    def tinker_path(self) -> str:
        return f"tinker://{self.run_id}/{SEGMENT_OF_KIND[self.kind]}/{self.name}"

    @property
    def checkpoint_id(self) -> str:
        return f"{SEGMENT_OF_KIND[self.kind]}/{self.name}"


def validate_name(name: str, field: str = "path") -> str:
    if not _NAME_RE.fullmatch(name or ""):
        raise InvalidRequestError(
            f"{field}: checkpoint name {name!r} must be 1-128 characters of letters, digits, "
            "'.', '_' or '-', starting with a letter or digit"
        )
    return name


def parse_path(path: str, field: str = "path") -> ParsedPath:
    """Parse a tinker:// or twinkle:// checkpoint path (400 naming ``field`` if malformed)."""
    scheme = next((s for s in _SCHEMES if path.startswith(s)), None)
    parts = path[len(scheme) :].split("/") if scheme else []
    if len(parts) != 3 or parts[1] not in KIND_SEGMENTS or not parts[0]:
        raise InvalidRequestError(
            f"{field}: {path!r} is not a checkpoint path; expected "
            "tinker://<run_id>/{weights|sampler_weights|external_weights}/<name>"
        )
    return ParsedPath(parts[0], KIND_SEGMENTS[parts[1]], validate_name(parts[2], field))


def new_storage_dir(data_dir: Path, user_id: int, p: ParsedPath) -> Path:
    """A fresh directory (not yet created) for a checkpoint; unique so overwrites never collide."""
    safe_run = re.sub(r"[^A-Za-z0-9._-]", "_", p.run_id)
    leaf = f"{p.name}-{uuid.uuid4().hex[:8]}"
    return data_dir / "checkpoints" / str(user_id) / safe_run / SEGMENT_OF_KIND[p.kind] / leaf


def readable_checkpoint(db: Session, user_id: int, path: str, field: str = "path") -> CheckpointRow:
    """The checkpoint at ``path`` if the user owns it or it is public and not expired; else 404."""
    p = parse_path(path, field)
    row = db.exec(select(CheckpointRow).where(CheckpointRow.tinker_path == p.tinker_path)).first()
    if row is None or (row.user_id != user_id and not row.public):
        raise NotFoundError(f"{field}: checkpoint {path} not found")
    if row.expires_at is not None and row.expires_at <= utcnow():
        delete_checkpoint(db, row)
        raise NotFoundError(f"{field}: checkpoint {path} not found (expired)")
    return row


#: key in a DB session's ``info`` of a callback ``(user_id, tinker_path)`` run after a checkpoint
#: is deleted: the gateway sets it on every request's session (gateway/deps.py) and the sweep's,
#: so the checkpoint quotas are given back whatever deleted it (a user, TTL expiry, the sweep)
CHECKPOINT_DELETED = "twinkle.checkpoint_deleted"


def delete_checkpoint(db: Session, row: CheckpointRow) -> None:
    user_id, path = row.user_id, row.tinker_path
    shutil.rmtree(row.storage_dir, ignore_errors=True)
    db.delete(row)
    db.commit()
    hook = db.info.get(CHECKPOINT_DELETED)
    if hook is not None:
        hook(user_id, path)
