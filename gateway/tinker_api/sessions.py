"""Tinker session lifecycle and service-level endpoints: client config, sessions, heartbeats,
telemetry, health and capabilities."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from gateway.context import ServicesDep
from gateway.db.tables import SessionRow, utcnow
from gateway.deps import ConfigDep, DbDep, EngineDep, PrincipalDep, owned_session
from gateway.errors import NotFoundError
from gateway.middleware import deprecation_for, parse_version, sdk_version
from gateway.quotas import QuotasDep
from gateway.runs.expiry import finish_sessions
from gateway.tinker_api.schemas import (
    ClientConfigRequest,
    ClientConfigResponse,
    ClientDynamicConfigResponse,
    CreateSessionRequest,
    CreateSessionResponse,
    FinishSessionRequest,
    FinishSessionResponse,
    GetServerCapabilitiesResponse,
    HealthResponse,
    SessionHeartbeatRequest,
    SessionHeartbeatResponse,
    TelemetryResponse,
    returns,
)
from gateway.training import queries
from gateway.training.sessions import open_session

router = APIRouter(prefix="/api/v1")


@router.get("/healthz", **returns(HealthResponse))
async def healthz(config: ConfigDep, engine: EngineDep) -> dict | JSONResponse:
    """200 only when the gateway and every replica of every model's Trainer and Sampler answer."""
    try:
        for m in config.models:
            await asyncio.wait_for(engine.every_trainer(m.name).info(), timeout=5)
            await asyncio.wait_for(engine.every_sampler(m.name).info(), timeout=5)
    except Exception as exc:  # not ready yet, or a replica died
        return JSONResponse(
            {"status": "unavailable", "detail": type(exc).__name__}, status_code=503
        )
    return {"status": "ok"}


@router.post("/client/config", **returns(ClientConfigResponse))
async def client_config(req: ClientConfigRequest, who: PrincipalDep, services: ServicesDep) -> dict:
    """The features this server negotiates with the SDK."""
    # Features are negotiated here. API keys (or JWTs when gateway.jwt_enabled), uncompressed
    # protobuf fwd/bwd bodies, no session-wide retrieve_futures, custom losses server-side unless
    # configured off (tinker-protocol.md §10; gateway/tinker_api/custom_losses.py).
    return {
        "pjwt_auth_enabled": services.jwt is not None,
        "proto_compress_fwdbwd": False,
        "sample_use_retrieve_futures": False,
        "sample_join_sampling_session": False,
        "custom_loss_server_side": services.config.custom_loss_server_side,
    }


@router.post("/client/dynamic_config", **returns(ClientDynamicConfigResponse))
async def dynamic_config(req: ClientConfigRequest, who: PrincipalDep) -> dict:
    """Settings the SDK refreshes while it runs."""
    return {"refresh_interval_sec": 300, "sample_cancel_enabled": False}


@router.post("/create_session", **returns(CreateSessionResponse))
async def create_session(
    req: CreateSessionRequest, request: Request, who: PrincipalDep, db: DbDep, config: ConfigDep
) -> dict:
    """Open a session (a ServiceClient); deprecated SDKs get a warning in the answer."""
    row = open_session(
        db,
        who,
        config,
        # informational, and the column holds 32 characters (Postgres enforces it)
        sdk_version=req.sdk_version[:32] if req.sdk_version else None,
        tags=req.tags,
        user_metadata=req.user_metadata or {},
        project_id=req.project_id,
        display_name=req.display_name,
    )
    out = {"session_id": row.id, "type": "create_session"}
    # The SDK logs these at warning / error level: the deprecation channel it shows users.
    version = sdk_version(request.headers) or parse_version(req.sdk_version)
    dep = deprecation_for(version, config.sdk_deprecated_below, config.sdk_unsupported_below)
    if dep is not None:
        out["warning_message" if dep[0] == "warning" else "error_message"] = dep[1]
    return out


@router.post("/session_heartbeat", **returns(SessionHeartbeatResponse))
async def session_heartbeat(req: SessionHeartbeatRequest, who: PrincipalDep, db: DbDep) -> dict:
    """Keep a session alive (a silent session expires and releases its adapters)."""
    row = owned_session(db, who, req.session_id)
    row.last_heartbeat_at = utcnow()
    db.add(row)
    db.commit()
    return {"type": "session_heartbeat"}


@router.post("/sessions/{session_id}/finish", **returns(FinishSessionResponse))
async def finish_session(
    session_id: str,
    req: FinishSessionRequest,
    who: PrincipalDep,
    db: DbDep,
    quotas: QuotasDep,
    engine: EngineDep,
) -> dict:
    """Finish a session: its training clients stop counting against the quota and their adapters
    are released (saved checkpoints stay)."""
    row = db.get(SessionRow, session_id)
    if row is None or row.user_id != who.user_id:
        raise NotFoundError(f"session_id: session {session_id!r} not found")
    if row.finished_at is None:
        await finish_sessions(
            db, engine, quotas, [row], req.reason.type if req.reason else "success"
        )
    return {"status": "finished", "session_id": session_id}


@router.post("/telemetry", **returns(TelemetryResponse))
async def telemetry(who: PrincipalDep) -> dict:
    """SDK telemetry: accepted and dropped."""
    return {"status": "accepted"}


@router.get("/get_server_capabilities", **returns(GetServerCapabilitiesResponse))
async def get_server_capabilities(who: PrincipalDep, config: ConfigDep, engine: EngineDep) -> dict:
    """The models served here, with their context length and max LoRA rank."""
    return {"supported_models": await queries.served_models(config, engine)}
