"""External (HF/PEFT-format) weights: save_weights_external, signed download URLs, downloads.

An export is the adapter in PEFT format (``adapter_model.safetensors`` + ``adapter_config.json``,
loadable with ``peft.PeftModel.from_pretrained``), saved in the model's seq_id order like any
checkpoint (path ``tinker://<run>/external_weights/<name>``). `get_external_weights_urls` answers
one URL per file, served by this gateway and signed with HMAC-SHA256 over (checkpoint, file,
expiry): whoever holds a URL can download without an API key until it expires; a URL whose
signature does not match is 403, an expired one 410, a deleted checkpoint 404. The signing key is
``$TWINKLE_URL_SIGNING_KEY`` or a random key kept in ``<data_dir>/secrets/url_signing.key`` (so
every replica and restart shares it).

With ``age_encryption_recipients`` (1 to 10 age recipients, each checked here) the export is
age-encrypted: the engine encrypts each file in memory before it is written
(engine/backends/age_seal.py), so the export store holds only ciphertext, named ``<file>.age``
(the SDK's convention); the URLs serve that ciphertext, and ``age -d -i <identity>`` gives the
PEFT files back.
"""

from __future__ import annotations

import hashlib
import hmac
import time
from datetime import UTC, datetime
from pathlib import Path

import pyrage
from fastapi import APIRouter, Query, Request
from fastapi.responses import FileResponse

from gateway.context import ContextDep
from gateway.db.tables import CheckpointRow, utcnow
from gateway.deps import ROW_ID_MAX, ConfigDep, DbDep, PrincipalDep, SecretsDep, owned_run
from gateway.errors import (
    GoneError,
    InvalidRequestError,
    NotFoundError,
    PermissionDeniedError,
)
from gateway.futures.store import fingerprint
from gateway.runs.checkpoints import validate_name
from gateway.tinker_api.saves import prepare_save
from gateway.tinker_api.schemas import (
    ExternalWeightsUrlsResponse,
    FutureResponse,
    SaveWeightsExternalRequest,
    returns,
)
from gateway.tinker_api.sequenced import Run, future_json, submit_sequenced
from gateway.training.checkpoints import SaveSpec

router = APIRouter(prefix="/api/v1")
EXPORT_FILES = ("adapter_model.safetensors", "adapter_config.json")
AGE_SUFFIX = ".age"  # the SDK's name for an encrypted file (save_weights_external's docs)
RECIPIENTS, MAX_RECIPIENTS = "age_encryption_recipients", 10  # the SDK's documented limit


def _recipients(keys: list[str] | None) -> tuple[str, ...]:
    """The age recipients of an encrypted export (None: a plain one), each parsed as age does:
    an ``age1...`` X25519 key (bech32) or an ``ssh-ed25519`` / ``ssh-rsa`` public key. A bad
    one fails the save in order, naming ``age_encryption_recipients[i]``."""
    if keys is None:
        return ()
    if not 0 < len(keys) <= MAX_RECIPIENTS:
        raise InvalidRequestError(
            f"{RECIPIENTS}: give 1 to {MAX_RECIPIENTS} recipients (or none for a plain export), "
            f"got {len(keys)}"
        )
    for i, key in enumerate(keys):
        kind = pyrage.ssh if key.startswith("ssh-") else pyrage.x25519
        try:
            kind.Recipient.from_str(key.strip())
        except pyrage.RecipientError as e:
            raise InvalidRequestError(
                f"{RECIPIENTS}[{i}]: not an age recipient (an 'age1...' X25519 key or an "
                f"'ssh-ed25519' / 'ssh-rsa' public key): {e}"
            ) from None
    return tuple(k.strip() for k in keys)


def export_files(row: CheckpointRow) -> tuple[str, ...]:
    """The files of an export: ``<file>.age`` for an encrypted one (its directory says which)."""
    encrypted = (Path(row.storage_dir) / (EXPORT_FILES[1] + AGE_SUFFIX)).is_file()
    return tuple(f + AGE_SUFFIX for f in EXPORT_FILES) if encrypted else EXPORT_FILES


def _signature(key: bytes, row: CheckpointRow, filename: str, expires: int) -> str:
    msg = f"{row.id}\n{row.tinker_path}\n{row.created_at.isoformat()}\n{filename}\n{expires}"
    return hmac.new(key, msg.encode(), hashlib.sha256).hexdigest()


@router.post("/save_weights_external", **returns(FutureResponse))
async def save_weights_external(req: SaveWeightsExternalRequest, t: ContextDep) -> dict:
    """Export the adapter in PEFT format under external_weights/<path>, in seq_id order."""
    fp = fingerprint(req.model_dump(mode="json"))
    run = owned_run(t.db, t.who, req.model_id, live=True)

    async def prepare() -> Run:
        recipients = _recipients(req.age_encryption_recipients)
        validate_name(req.path, "path")
        spec = SaveSpec(
            "external", req.path, True, req.ttl_seconds, None, False, age_recipients=recipients
        )
        return await prepare_save(t, run, req.seq_id, spec)

    rec = await submit_sequenced(t, run, req.seq_id, fp, "save", prepare)
    return future_json(rec, run.id)


@router.get(
    "/training_runs/{run_id}/checkpoints/{checkpoint_id:path}/external_weights_urls",
    **returns(ExternalWeightsUrlsResponse),
)
async def external_weights_urls(
    run_id: str,
    checkpoint_id: str,
    request: Request,
    who: PrincipalDep,
    db: DbDep,
    secrets: SecretsDep,
    config: ConfigDep,
) -> dict:
    """Signed download URLs of an export's files (no API key needed until they expire)."""
    from gateway.tinker_api.checkpoints import visible_checkpoint

    row = visible_checkpoint(db, who, run_id, checkpoint_id)
    if row.kind != "external":
        raise InvalidRequestError(
            f"checkpoint_id: {checkpoint_id} is not an external_weights/ checkpoint; "
            "create one with save_weights_external"
        )
    expires = int(time.time() + config.download_url_ttl_seconds)
    key = secrets.url_signing
    base = str(request.base_url).rstrip("/")
    urls = {
        name: f"{base}/api/v1/external_weights/{row.id}/{name}"
        f"?expires={expires}&sig={_signature(key, row, name, expires)}"
        for name in export_files(row)
    }
    return {"urls": urls, "expires": datetime.fromtimestamp(expires, UTC).isoformat()}


@router.get("/external_weights/{checkpoint_row_id}/{filename}", response_model=None)
async def download_external_weights(
    checkpoint_row_id: int,
    filename: str,
    db: DbDep,
    secrets: SecretsDep,
    expires: int = Query(...),
    sig: str = Query(..., max_length=128),
) -> FileResponse:
    """No API key: the signature is the credential."""
    # an id beyond a row id cannot exist (SQLite would raise OverflowError, Postgres 'integer
    # out of range': a 500)
    ok_id = 0 < checkpoint_row_id <= ROW_ID_MAX
    row = db.get(CheckpointRow, checkpoint_row_id) if ok_id else None
    if row is None or row.kind != "external" or filename not in export_files(row):
        raise NotFoundError("download: no such file")
    good = _signature(secrets.url_signing, row, filename, expires)
    # bytes: compare_digest refuses str with non-ASCII characters (a TypeError, so a 500, on a
    # query string with any)
    if not hmac.compare_digest(good.encode(), sig.encode("utf-8", "surrogatepass")):
        raise PermissionDeniedError("download: the URL's signature does not match")
    if expires < time.time():
        raise GoneError(
            "download: this URL has expired; ask get_external_weights_urls for new ones"
        )
    if row.expires_at is not None and row.expires_at <= utcnow():
        raise NotFoundError("download: the checkpoint has expired")
    path = Path(row.storage_dir) / filename
    if not path.is_file():
        raise NotFoundError("download: the checkpoint's files are gone")
    return FileResponse(path, filename=filename, media_type="application/octet-stream")
