"""Native management routes: sessions and heartbeats, capabilities, capacity, training runs and
checkpoints, and the base models' tokenizer files.

Runs and checkpoints are the same rows the Tinker routes serve (`gateway.training.queries`, so
both clients see one list); checkpoint paths are returned in both spellings
(``tinker_path`` and ``twinkle_path``).
"""

from __future__ import annotations

import mimetypes
from typing import Any

from fastapi import APIRouter, Query
from fastapi.responses import Response

from gateway.db.tables import utcnow
from gateway.deps import (
    DB_INT_MAX,
    ConfigDep,
    DbDep,
    EngineDep,
    PrincipalDep,
    owned_session,
)
from gateway.errors import InvalidRequestError, NotFoundError
from gateway.quotas import QuotasDep
from gateway.runs.checkpoints import delete_checkpoint, readable_checkpoint
from gateway.training import queries
from gateway.training.sessions import open_session
from gateway.twinkle_api.schemas import CreateSessionRequest, HeartbeatRequest

router = APIRouter(prefix="/api/v1/twinkle")


def _with_twinkle_paths(obj: Any) -> Any:
    """Add ``twinkle_path`` next to every ``tinker_path`` in a JSON body."""
    if isinstance(obj, dict):
        out = {k: _with_twinkle_paths(v) for k, v in obj.items()}
        if isinstance(obj.get("tinker_path"), str):
            out["twinkle_path"] = "twinkle://" + obj["tinker_path"].removeprefix("tinker://")
        return out
    if isinstance(obj, list):
        return [_with_twinkle_paths(v) for v in obj]
    return obj


@router.post("/create_session")
async def create_session(
    req: CreateSessionRequest, who: PrincipalDep, db: DbDep, config: ConfigDep
) -> dict:
    row = open_session(
        db,
        who,
        config,
        # the column holds 32 characters (Postgres enforces it; the prefix takes 15): the rest of
        # a long version string is informational only
        sdk_version=f"twinkle_client/{req.client_version}"[:32] if req.client_version else None,
        tags=req.tags,
        user_metadata=req.metadata or {},
    )
    return {"session_id": row.id}


@router.post("/session_heartbeat")
async def session_heartbeat(req: HeartbeatRequest, who: PrincipalDep, db: DbDep) -> dict:
    row = owned_session(db, who, req.session_id)
    row.last_heartbeat_at = utcnow()
    db.add(row)
    db.commit()
    return {"session_id": row.id, "last_heartbeat_at": row.last_heartbeat_at.isoformat() + "Z"}


@router.get("/get_server_capabilities")
async def get_server_capabilities(who: PrincipalDep, config: ConfigDep, engine: EngineDep) -> dict:
    return {"supported_models": await queries.served_models(config, engine)}


@router.get("/capacity_info")
async def capacity_info(who: PrincipalDep, config: ConfigDep, engine: EngineDep) -> dict:
    """Adapter slots per base model. Adapters beyond ``max_loras`` are offloaded to disk and
    reloaded on use, so a full pool slows tenants down but never refuses them."""
    models = []
    for m in config.models:
        pools = [s["pool"] for s in await engine.every_trainer(m.name).stats()]  # every replica
        used = sum(int(p["resident"]) for p in pools)
        capacity = sum(int(p["capacity"]) for p in pools)
        models.append(
            {
                "base_model": m.name,
                "max_loras": capacity,
                "used_loras": used,
                "free_loras": max(0, capacity - used),
                "offloaded_loras": sum(int(p["offloaded"]) for p in pools),
            }
        )
    return {"models": models}


@router.get("/training_runs")
async def list_training_runs(
    who: PrincipalDep,
    db: DbDep,
    limit: int = Query(20, ge=1, le=1000),
    offset: int = Query(0, ge=0, le=DB_INT_MAX),
) -> dict:
    return _with_twinkle_paths(queries.list_runs(db, who, offset, limit))


@router.get("/training_runs/{run_id}")
async def get_training_run(run_id: str, who: PrincipalDep, db: DbDep) -> dict:
    return _with_twinkle_paths(queries.get_run(db, who, run_id))


@router.get("/training_runs/{run_id}/checkpoints")
async def list_checkpoints(run_id: str, who: PrincipalDep, db: DbDep) -> dict:
    return _with_twinkle_paths(queries.list_run_checkpoints(db, who, run_id))


@router.get("/checkpoint")
async def get_checkpoint(who: PrincipalDep, db: DbDep, path: str = Query(...)) -> dict:
    row = readable_checkpoint(db, who.user_id, path, "path")
    return _with_twinkle_paths({"run_id": row.run_id, **queries.checkpoint_json(row)})


@router.delete("/checkpoint")
async def delete_checkpoint_route(
    who: PrincipalDep, db: DbDep, quotas: QuotasDep, path: str = Query(...)
) -> dict:
    row = readable_checkpoint(db, who.user_id, path, "path")
    if row.user_id != who.user_id:  # a public checkpoint of someone else: readable, not theirs
        raise NotFoundError(f"path: checkpoint {path} not found")
    delete_checkpoint(db, row)
    await quotas.release_checkpoint(who.user_id, who.org_id, row.tinker_path)  # frees its slot
    return {"deleted": path}


def _served(config, base_model: str) -> None:
    if config.model(base_model) is None:
        raise InvalidRequestError(
            f"base_model: {base_model!r} is not served here; available: "
            f"{[x.name for x in config.models]}"
        )


@router.get("/tokenizer")
async def tokenizer_files(
    who: PrincipalDep, config: ConfigDep, engine: EngineDep, base_model: str = Query(...)
) -> dict:
    """The tokenizer files of ``base_model`` a client may download (a client needs no hub); the
    Sampler, which holds the model, lists and serves them."""
    _served(config, base_model)
    files = await engine.sampler(base_model).tokenizer_files()
    return {
        "base_model": base_model,
        "files": [{"name": f, "size_bytes": size} for f, size in files.items()],
    }


@router.get("/tokenizer/{filename}")
async def tokenizer_file(
    filename: str,
    who: PrincipalDep,
    config: ConfigDep,
    engine: EngineDep,
    base_model: str = Query(...),
) -> Response:
    _served(config, base_model)
    sampler = engine.sampler(base_model)
    if filename not in await sampler.tokenizer_files():
        raise NotFoundError(
            f"filename: {filename!r} is not a tokenizer file of {base_model}; "
            f"GET /api/v1/twinkle/tokenizer lists them"
        )
    media = mimetypes.guess_type(filename)[0] or "text/plain"  # as a FileResponse would say
    return Response(
        await sampler.tokenizer_file(filename),
        media_type=media,
        headers={"content-disposition": f'attachment; filename="{filename}"'},
    )
