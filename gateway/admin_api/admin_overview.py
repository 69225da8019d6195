"""Admin API for the operators' console: ``/api/v1/admin/whoami`` (the console's sign-in check:
403 for a non-admin key) and ``/api/v1/admin/overview`` (one snapshot of the whole service).

The overview holds gauges (queue depth, oldest wait, adapters loaded / offloaded, active tenants)
and cumulative counters (tokens in the usage ledger, HTTP requests and errors answered by this
gateway replica since it started). Rates (tokens/s, error rate) are the difference of two
snapshots over their time apart: the console polls and keeps the history, as a Prometheus
``rate()`` would, so the gateway keeps no time series of its own.
"""

from __future__ import annotations

import asyncio
from datetime import timedelta

from fastapi import APIRouter, Request
from sqlalchemy import func
from sqlmodel import col, select

from gateway.accounts.keys import AdminPrincipalDep
from gateway.accounts.usage import hour_of
from gateway.context import services_of
from gateway.db.tables import UsageBucketRow, utcnow
from gateway.deps import ConfigDep, DbDep, EngineDep

#: a replica that does not answer its stats within this many seconds is reported, not waited for
STATS_TIMEOUT_S = 5.0
#: usage-ledger kinds counted as training and as sampling tokens
TRAINING_KINDS = ("training",)
SAMPLING_KINDS = ("sampling_prefill", "sampling_sample")

router = APIRouter(prefix="/api/v1/admin", tags=["admin"])


@router.get("/whoami")
async def whoami(who: AdminPrincipalDep) -> dict:
    """The admin key's owner: what the console shows after sign-in."""
    return {
        "user_id": who.user_id,
        "user": who.user_name,
        "org_id": who.org_id,
        "org": who.org_name,
        "scope": who.scope,
        "key_prefix": who.key_prefix,
    }


async def _stats(engine, model: str, role: str) -> dict:
    replica = engine.trainer(model) if role == "trainer" else engine.sampler(model)
    try:
        return await asyncio.wait_for(replica.stats(), timeout=STATS_TIMEOUT_S)
    except Exception as exc:  # a replica that does not answer is reported, not fatal
        return {"error": type(exc).__name__}


def _mode(execution) -> str | None:
    """The Trainer's execution mode: its stats hold ``{"mode": ..., <probe costs>}``."""
    return execution.get("mode") if isinstance(execution, dict) else execution


def _model_row(m, trainer: dict, sampler: dict) -> dict:
    queue = trainer.get("queue") or []
    adapters = trainer.get("adapters") or []
    return {
        "name": m.name,
        "trainer_replicas": m.trainer.num_replicas,
        "sampler_replicas": m.sampler.num_replicas,
        "training_jobs_queued": sum(q["jobs"] for q in queue),
        "sampling_requests_queued": int(sampler.get("queued", 0)),
        "oldest_wait_s": max((q["oldest_wait_s"] for q in queue), default=0.0),
        "tenants_queued": sorted({q["tenant"] for q in queue}),
        "adapters_loaded": sum(a["state"] == "loaded" for a in adapters),
        "adapters_offloaded": sum(a["state"] == "offloaded" for a in adapters),
        "execution": _mode(trainer.get("execution")),
        "error": trainer.get("error") or sampler.get("error"),
    }


def _request_counts(request: Request) -> dict:
    """HTTP requests answered by this replica since it started (None without metrics)."""
    metrics = services_of(request.app).metrics
    if metrics is None:
        return {"total": None, "server_errors": None, "client_errors": None}
    total = server = client = 0
    for family in metrics.requests.collect():
        for s in family.samples:
            if not s.name.endswith("_total"):
                continue
            total += int(s.value)
            status = s.labels.get("status", "")
            server += int(s.value) if status.startswith("5") else 0
            client += int(s.value) if status.startswith("4") else 0
    return {"total": total, "server_errors": server, "client_errors": client}


def _token_totals(db) -> dict:
    rows = db.exec(
        select(UsageBucketRow.kind, func.sum(UsageBucketRow.quantity)).group_by(
            col(UsageBucketRow.kind)
        )
    ).all()
    by_kind = {kind: int(total or 0) for kind, total in rows}
    return {
        "training": sum(by_kind.get(k, 0) for k in TRAINING_KINDS),
        "sampling": sum(by_kind.get(k, 0) for k in SAMPLING_KINDS),
    }


@router.get("/overview")
async def overview(
    request: Request, who: AdminPrincipalDep, config: ConfigDep, engine: EngineDep, db: DbDep
) -> dict:
    """Models and their queues, active tenants, cumulative tokens and requests (see module doc).
    With several Trainer replicas, a model's stats are those of the replica that answered."""
    models = []
    for m in config.models:
        trainer, sampler = await asyncio.gather(
            _stats(engine, m.name, "trainer"), _stats(engine, m.name, "sampler")
        )
        models.append(_model_row(m, trainer, sampler))
    now = utcnow()
    # the ledger is bucketed by UTC hour: "active" = usage in this hour or the one before
    since = hour_of(now) - timedelta(hours=1)
    active = db.exec(
        select(func.count(func.distinct(UsageBucketRow.user_id))).where(
            UsageBucketRow.bucket_start >= since
        )
    ).one()
    queued = {t for row in models for t in row["tenants_queued"]}
    return {
        "at": now.isoformat() + "Z",
        "gateway_replicas": config.gateway.num_replicas,
        "models": models,
        "queue": {
            "training_jobs": sum(r["training_jobs_queued"] for r in models),
            "sampling_requests": sum(r["sampling_requests_queued"] for r in models),
            "oldest_wait_s": max((r["oldest_wait_s"] for r in models), default=0.0),
        },
        "active_tenants": {"queued_now": len(queued), "last_hour": int(active or 0)},
        "tokens_total": _token_totals(db),
        "requests": _request_counts(request),
    }
