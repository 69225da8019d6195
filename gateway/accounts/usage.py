"""The usage ledger: hourly buckets of training tokens, prefill tokens, sampled tokens, checkpoint
saves and checkpoint storage (GB-hours).

Owns recording (an upsert into the bucket of the current UTC hour, keyed by user, session, base
model and kind; works on SQLite and Postgres), storage accrual (the bytes of every kept
checkpoint times the hours since the last accrual, run periodically), and the queries behind the
admin API and the Tinker SDK's ``AdminClient.get_billing_usage``.
"""

from __future__ import annotations

import logging
from datetime import datetime, timedelta

from sqlalchemy import Engine, func
from sqlmodel import Session, col, select

from gateway.db.tables import CheckpointRow, UsageBucketRow, UserRow, utcnow

log = logging.getLogger(__name__)
KINDS = ("training", "sampling_prefill", "sampling_sample", "checkpoint", "storage")
GB = 1e9
STORAGE_ACCRUAL_S = 300.0


def hour_of(ts: datetime) -> datetime:
    return ts.replace(minute=0, second=0, microsecond=0)


def _upsert(session: Session, values: dict, quantity: int, gb_hours: float) -> None:
    dialect = session.get_bind().dialect.name
    if dialect == "postgresql":
        from sqlalchemy.dialects.postgresql import insert
    else:
        from sqlalchemy.dialects.sqlite import insert
    # SQLModel sets __table__ when the class is created; its type stubs do not declare it.
    table = UsageBucketRow.__table__  # pyright: ignore[reportAttributeAccessIssue]
    stmt = insert(table).values(**values, quantity=quantity, gigabyte_hours=gb_hours)
    stmt = stmt.on_conflict_do_update(
        index_elements=["bucket_start", "user_id", "session_id", "base_model", "kind"],
        set_={
            "quantity": table.c.quantity + stmt.excluded.quantity,
            "gigabyte_hours": table.c.gigabyte_hours + stmt.excluded.gigabyte_hours,
        },
    )
    session.execute(stmt)


class UsageLedger:
    def __init__(self, db_engine: Engine) -> None:
        self._db = db_engine
        self._last_accrual: datetime | None = None

    def record(
        self,
        *,
        user_id: int,
        org_id: int | None,
        kind: str,
        quantity: int = 0,
        gigabyte_hours: float = 0.0,
        session_id: str | None = None,
        base_model: str | None = None,
        at: datetime | None = None,
    ) -> None:
        """Add to the current hour's bucket. Best effort: a failure is logged, never raised into
        the training or sampling path."""
        assert kind in KINDS, kind
        values = {
            "bucket_start": hour_of(at or utcnow()),
            "org_id": org_id,
            "user_id": user_id,
            "session_id": session_id or "",
            "base_model": base_model or "",
            "kind": kind,
        }
        try:
            with Session(self._db) as s:
                _upsert(s, values, int(quantity), float(gigabyte_hours))
                s.commit()
        except Exception:
            log.warning("usage ledger write failed (%s)", kind, exc_info=True)

    async def run_storage_accrual(self, every_s: float = STORAGE_ACCRUAL_S) -> None:
        """Accrue storage GB-hours every ``every_s`` seconds until cancelled (each gateway
        replica runs one; with several replicas, run the ledger on one of them only — not yet
        coordinated)."""
        import asyncio

        while True:
            try:
                await asyncio.to_thread(self.accrue_storage)
            except Exception:
                log.warning("storage accrual failed", exc_info=True)
            await asyncio.sleep(every_s)

    def accrue_storage(self, now: datetime | None = None) -> None:
        """Charge GB-hours for every kept checkpoint since the last accrual (first call: start)."""
        now = now or utcnow()
        last, self._last_accrual = self._last_accrual, now
        if last is None or now <= last:
            return
        hours = (now - last).total_seconds() / 3600.0
        with Session(self._db) as s:
            rows = s.exec(
                select(CheckpointRow.user_id, UserRow.org_id, func.sum(CheckpointRow.size_bytes))
                .join(UserRow, col(UserRow.id) == CheckpointRow.user_id)
                .where(CheckpointRow.ephemeral == False)  # noqa: E712
                .group_by(col(CheckpointRow.user_id), col(UserRow.org_id))
            ).all()
        for user_id, org_id, size in rows:
            if size:
                self.record(
                    user_id=user_id,
                    org_id=org_id,
                    kind="storage",
                    gigabyte_hours=float(size) / GB * hours,
                    at=now,
                )


def query(
    session: Session,
    *,
    org_id: int | None,
    start: datetime,
    end: datetime,
    user_id: int | None = None,
) -> list[UsageBucketRow]:
    q = select(UsageBucketRow).where(
        UsageBucketRow.bucket_start >= start, UsageBucketRow.bucket_start < end
    )
    if org_id is not None:
        q = q.where(UsageBucketRow.org_id == org_id)
    if user_id is not None:
        q = q.where(UsageBucketRow.user_id == user_id)
    return list(session.exec(q.order_by(col(UsageBucketRow.bucket_start), col(UsageBucketRow.id))))


def billing_event(row: UsageBucketRow, user_name: str | None) -> dict:
    """A row as the SDK's ``BillingUsageEvent``."""
    if row.kind == "storage":
        info: dict = {"type": "storage", "free": False, "gigabyte_hours": row.gigabyte_hours}
    elif row.kind == "checkpoint":
        info = {"type": "checkpoint", "count": row.quantity}
    elif row.kind == "sampling_prefill":
        info = {"type": "sampling_prefill", "cached": False, "token_count": row.quantity}
    else:
        info = {"type": row.kind, "token_count": row.quantity}
    return {
        "bucket_start": row.bucket_start.isoformat() + "Z",
        "bucket_end": (row.bucket_start + timedelta(hours=1)).isoformat() + "Z",
        "base_model": row.base_model or None,
        "user_id": f"tml:user:{row.user_id}",
        "user_name": user_name,
        "session_id": row.session_id or None,
        "event_info": info,
    }
