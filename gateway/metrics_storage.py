"""Storage gauges of the gateway's ``/metrics``, read from the DB and the disk at scrape time.

Owns `StorageCollector`: checkpoint bytes kept, how full the fullest org and the fullest user are
against their ``max_checkpoint_bytes`` quota, and the data dir's disk. These feed the "storage
near cap" alert (infra/observability/). Computed at most every `CACHE_S` seconds (two grouped
queries), so scraping several times a minute costs the DB nothing noticeable. No label names a
subject: the fill ratio is the maximum over all orgs (users), by level only.
"""

from __future__ import annotations

import shutil
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector
from sqlalchemy import Engine, func
from sqlmodel import Session, col, select

from gateway.db.tables import CheckpointRow, QuotaLimitRow, UserRow

#: seconds a computed snapshot is reused (Prometheus scrapes every 15 s by default)
CACHE_S = 10.0
QUOTA = "max_checkpoint_bytes"


def fill_ratios(session: Session, default_user_limit: int | None) -> tuple[int, dict[str, float]]:
    """(checkpoint bytes kept, {"org": max used/limit over orgs with a limit, "user": the same
    over users, their own limit or ``default_user_limit``}); 0.0 where no subject has a limit.
    Ephemeral checkpoints do not count, as in the quota (gateway.quotas.service)."""
    used: dict[int, int] = {
        int(uid): int(b or 0)
        for uid, b in session.exec(  # pyright: ignore[reportArgumentType] (sum may be NULL)
            select(CheckpointRow.user_id, func.sum(CheckpointRow.size_bytes))
            .where(CheckpointRow.ephemeral == False)  # noqa: E712
            .group_by(col(CheckpointRow.user_id))
        )
    }
    org_of: dict[int, int | None] = {
        int(u): o for u, o in session.exec(select(UserRow.id, UserRow.org_id)) if u is not None
    }
    limits = {
        (t, int(s)): int(v)
        for t, s, v in session.exec(
            select(QuotaLimitRow.subject_type, QuotaLimitRow.subject_id, QuotaLimitRow.value).where(
                QuotaLimitRow.name == QUOTA
            )
        )
    }
    org_used: dict[int, int] = {}
    for uid, b in used.items():
        org = org_of.get(uid)
        if org is not None:
            org_used[org] = org_used.get(org, 0) + b

    def ratio(b: int, limit: int) -> float:
        return b / limit if limit > 0 else (1.0 if b > 0 else 0.0)

    out = {"org": 0.0, "user": 0.0}
    for (t, sid), limit in limits.items():
        if t == "org":
            out["org"] = max(out["org"], ratio(org_used.get(sid, 0), limit))
    for uid in org_of:
        limit = limits.get(("user", uid), default_user_limit)
        if limit is not None:
            out["user"] = max(out["user"], ratio(used.get(uid, 0), limit))
    return sum(used.values()), out


class StorageCollector(Collector):
    def __init__(
        self, db_engine: Callable[[], Engine | None], data_dir: Path, default_user_limit: int | None
    ) -> None:
        """``db_engine()``: the app's engine once its lifespan has made it, else None."""
        self._db = db_engine
        self._data_dir = data_dir
        self._default = default_user_limit
        self._lock = threading.Lock()
        self._at = -CACHE_S
        self._snapshot: tuple[int, dict[str, float]] | None = None

    def _read(self) -> tuple[int, dict[str, float]] | None:
        with self._lock:
            if time.monotonic() - self._at >= CACHE_S:
                engine = self._db()
                if engine is not None:
                    with Session(engine) as s:
                        self._snapshot = fill_ratios(s, self._default)
                    self._at = time.monotonic()
            return self._snapshot

    def collect(self) -> Iterator[GaugeMetricFamily]:
        snap = self._read()
        if snap is not None:
            kept, ratios = snap
            yield GaugeMetricFamily(
                "twinkle_checkpoint_bytes", "Bytes of saved checkpoints kept (not ephemeral)", kept
            )
            fam = GaugeMetricFamily(
                "twinkle_storage_quota_fill_ratio",
                "Checkpoint bytes kept / max_checkpoint_bytes of the fullest org or user (by "
                "level; 0 when no subject has a limit)",
                labels=["level"],
            )
            for level, r in ratios.items():
                fam.add_metric([level], r)
            yield fam
        try:
            du = shutil.disk_usage(self._data_dir)
        except OSError:
            return
        yield GaugeMetricFamily(
            "twinkle_data_dir_free_bytes", "Free bytes on the data dir's filesystem", du.free
        )
        yield GaugeMetricFamily(
            "twinkle_data_dir_size_bytes", "Size of the data dir's filesystem", du.total
        )
