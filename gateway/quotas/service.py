"""Quota enforcement: the `Quotas` service the routes call, and its FastAPI dependency.

Owns turning a caller's limits (`gateway.quotas.limits`) into atomic store operations
(`gateway.quotas.store`) and store denials into the right HTTP answer:

* hard caps (training clients, LoRA rank, checkpoint count and bytes, a single request larger
  than a rate limit) → `QuotaExceededError`, 403, naming the quota, its limit and the current use
  (the SDK does not retry 403; it retries 429/409/5xx for minutes and pauses an hour on 402);
* soft limits (token rates, concurrent sampling requests) → `RateLimitedError`, 429 with
  ``retry-after``, which the SDK waits out and retries with the same seq_id.

Every check runs at the organization and the user level in one atomic store call, so concurrent
requests (on any gateway replica, with Redis) never overshoot. Gauges that mirror DB state
(training clients of unfinished sessions, kept checkpoints) are seeded from the DB the first time
a subject is seen by the store.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Annotated

from fastapi import Depends, Request
from sqlalchemy import Engine
from sqlmodel import Session, col, select

from gateway.accounts.keys import Principal
from gateway.config import ServerConfig
from gateway.db.tables import CheckpointRow, SessionRow, TrainingRunRow, UserRow
from gateway.errors import QuotaExceededError, RateLimitedError
from gateway.quotas.limits import Limits, resolve_limits
from gateway.quotas.store import Denial, GaugeCheck, MemoryQuotaStore, RateCheck, RedisQuotaStore

if TYPE_CHECKING:  # gateway.context imports this module: the type only
    from gateway.context import AppServices

__all__ = [
    "MemoryQuotaStore",
    "Quotas",
    "QuotasDep",
    "RedisQuotaStore",
    "build_quotas",
    "get_quotas",
]

#: (window seconds, bucket seconds) of the two rate windows
WINDOWS = {"minute": (60.0, 1.0), "day": (86400.0, 600.0)}


def _release(db: Session) -> None:
    """End the request session's read transaction, so its pooled connection is not held while
    the route awaits the quota store (routes use the DB synchronously on the event loop; holding
    connections across awaits exhausts the pool under a burst and stalls the loop). Objects
    loaded before are expired and reload on next access."""
    if db.in_transaction():
        db.commit()


def _label(level: str, who: Principal) -> str:
    if level == "org":
        return f"organization {who.org_name or who.org_id!s}"
    return f"user {who.user_name}"


class Quotas:
    def __init__(
        self,
        store: MemoryQuotaStore | RedisQuotaStore,
        db_engine: Engine,
        *,
        default_user_quotas: dict[str, int] | None = None,
        rate_windows: dict[str, tuple[float, float]] | None = None,
    ) -> None:
        self.store = store
        self._db = db_engine
        self._defaults = dict(default_user_quotas or {})
        self._windows = rate_windows or WINDOWS
        #: called with (quota name, level) on every denial (the app's metrics counter). Counted
        #: here, not in the HTTP error handler, because some denials become failed futures.
        self.on_denial: Callable[[str, str], None] | None = None

    def _denied(self, name: str, level: str) -> None:
        if self.on_denial is not None:
            self.on_denial(name, level)

    # -- limits ------------------------------------------------------------------------------
    def limits(self, who: Principal, db: Session | None = None) -> Limits:
        """The caller's limits. Pass the request's session: a route must never wait for a second
        pooled connection while it holds one (under load that deadlocks the event loop)."""
        if db is not None:
            limits = resolve_limits(db, who.org_id, who.user_id, self._defaults)
            _release(db)
            return limits
        with Session(self._db) as s:
            return resolve_limits(s, who.org_id, who.user_id, self._defaults)

    def _levels(self, who: Principal) -> list[tuple[str, int]]:
        out = [("user", who.user_id)]
        if who.org_id is not None:
            out.insert(0, ("org", who.org_id))
        return out

    def _exceeded(self, name: str, level: str, who: Principal, limit: int, current: int, what: str):
        self._denied(name, level)
        return QuotaExceededError(
            f"quota {name} exceeded for {_label(level, who)}: limit {limit}, current use "
            f"{current}{what}",
            name,
            limit,
            current,
        )

    # -- static ------------------------------------------------------------------------------
    def check_lora_rank(self, who: Principal, rank: int, limits: Limits | None = None) -> None:
        limits = limits or self.limits(who)
        for level, _ in self._levels(who):
            cap = limits.get(level, "max_lora_rank")
            if cap is not None and rank > cap:
                raise self._exceeded(
                    "max_lora_rank", level, who, cap, rank, " (the requested lora_config.rank)"
                )

    # -- gauges ------------------------------------------------------------------------------
    async def _seed(self, key: str, loader: Callable[[], dict[str, int]]) -> None:
        if not await self.store.is_seeded(key):
            await self.store.seed(key, loader())

    def _with_db(self, db: Session | None, fn):
        if db is not None:
            out = fn(db)
            _release(db)
            return out
        with Session(self._db) as s:
            return fn(s)

    def _user_ids(self, s: Session, level: str, subject: int) -> list[int]:
        if level == "user":
            return [subject]
        ids = s.exec(select(UserRow.id).where(UserRow.org_id == subject))
        return [uid for uid in ids if uid is not None]  # a stored row's primary key is never None

    def _load_training_clients(self, s: Session, level: str, subject: int) -> dict[str, int]:
        if True:
            ids = self._user_ids(s, level, subject)
            rows = s.exec(
                select(TrainingRunRow.id)
                .join(SessionRow, col(SessionRow.id) == TrainingRunRow.session_id)
                .where(col(TrainingRunRow.user_id).in_(ids), col(SessionRow.finished_at).is_(None))
            )
            return dict.fromkeys(rows, 1)

    def _load_checkpoints(self, s: Session, level: str, subject: int) -> dict[str, int]:
        if True:
            ids = self._user_ids(s, level, subject)
            rows = s.exec(
                select(CheckpointRow.tinker_path, CheckpointRow.size_bytes).where(
                    col(CheckpointRow.user_id).in_(ids),
                    CheckpointRow.ephemeral == False,  # noqa: E712
                )
            )
            return {p: int(b) for p, b in rows}

    async def _gauge_acquire(
        self,
        who: Principal,
        gauge: str,
        quotas: list[tuple[str, str]],
        member: str,
        value: int,
        loader,
        limits: Limits | None = None,
        db: Session | None = None,
    ) -> None:
        """Take ``member`` in ``gauge`` at every level; ``quotas``: (quota name, "count"|"sum")."""
        limits = limits or self.limits(who, db)
        checks, names = [], []
        for level, subject in self._levels(who):
            key = f"{level}:{subject}:{gauge}"
            if loader is not None:
                await self._seed(
                    key, lambda lv=level, sb=subject: self._with_db(db, lambda s: loader(s, lv, sb))
                )
            kw: dict[str, int | None] = {}
            for qname, what in quotas:
                kw["max_count" if what == "count" else "max_sum"] = limits.get(level, qname)
            checks.append(GaugeCheck(key, **kw))
            names.append(level)
        denial = await self.store.acquire(checks, member, value)
        if denial is not None:
            level = names[denial.index]
            qname = next(q for q, w in quotas if w == denial.what)
            limit = limits.get(level, qname)
            assert limit is not None
            self._raise_gauge(qname, level, who, limit, denial)

    def _raise_gauge(self, qname: str, level: str, who: Principal, limit: int, d: Denial) -> None:
        if qname == "max_concurrent_samples":
            self._denied(qname, level)
            raise RateLimitedError(
                f"too many concurrent sampling requests for {_label(level, who)}: {d.current} in "
                f"flight, the limit is {limit} (quota max_concurrent_samples); retry later",
                1.0,
            )
        raise self._exceeded(qname, level, who, limit, d.current, "")

    def _keys(self, user_id: int, org_id: int | None, gauge: str) -> list[str]:
        keys = [f"user:{user_id}:{gauge}"]
        if org_id is not None:
            keys.append(f"org:{org_id}:{gauge}")
        return keys

    async def acquire_training_client(
        self, who: Principal, model_id: str, limits: Limits, db: Session | None = None
    ) -> None:
        await self._gauge_acquire(
            who,
            "training_clients",
            [("max_training_clients", "count")],
            model_id,
            1,
            self._load_training_clients,
            limits,
            db,
        )

    async def release_training_clients(
        self, user_id: int, org_id: int | None, model_ids: list[str]
    ) -> None:
        for mid in model_ids:
            await self.store.release(self._keys(user_id, org_id, "training_clients"), mid)

    async def acquire_sample_slot(self, who: Principal, member: str, limits: Limits) -> None:
        await self._gauge_acquire(
            who, "samples", [("max_concurrent_samples", "count")], member, 1, None, limits
        )

    async def release_sample_slot(self, who: Principal, member: str) -> None:
        await self.store.release(self._keys(who.user_id, who.org_id, "samples"), member)

    async def reserve_checkpoint(
        self, who: Principal, tinker_path: str, estimate: int, db: Session
    ) -> None:
        """Before a save: 403 when the kept checkpoints are at their count or byte cap (a path
        already kept is an overwrite and always fits its slot)."""
        await self._gauge_acquire(
            who,
            "checkpoints",
            [("max_checkpoints", "count"), ("max_checkpoint_bytes", "sum")],
            tinker_path,
            max(0, estimate),
            self._load_checkpoints,
            None,
            db,
        )

    async def commit_checkpoint(
        self, user_id: int, org_id: int | None, tinker_path: str, size: int
    ) -> None:
        await self.store.set_value(self._keys(user_id, org_id, "checkpoints"), tinker_path, size)

    async def release_checkpoint(self, user_id: int, org_id: int | None, tinker_path: str) -> None:
        await self.store.release(self._keys(user_id, org_id, "checkpoints"), tinker_path)

    # -- rates -------------------------------------------------------------------------------
    def _rate_checks(self, who: Principal, kind: str, limits: Limits):
        checks, meta = [], []
        for level, subject in self._levels(who):
            for window, (win_s, bucket_s) in self._windows.items():
                qname = f"{kind}_tokens_per_{window}"
                limit = limits.get(level, qname)
                if limit is not None:
                    checks.append(RateCheck(f"{level}:{subject}:{qname}", limit, win_s, bucket_s))
                    meta.append((level, qname, limit))
        return checks, meta

    async def charge_tokens(
        self, who: Principal, kind: str, amount: int, limits: Limits
    ) -> list[RateCheck]:
        """Charge ``amount`` tokens (kind "train" | "sample") against every rate window; 429 with
        retry-after when a window is full, 403 when the request alone exceeds a limit. Returns the
        windows charged (for `refund_tokens`)."""
        checks, meta = self._rate_checks(who, kind, limits)
        if not checks or amount <= 0:
            return []
        for level, qname, limit in meta:
            if amount > limit:
                raise self._exceeded(
                    qname, level, who, limit, amount, " (tokens in this one request)"
                )
        denial = await self.store.charge(checks, amount)
        if denial is not None:
            level, qname, limit = meta[denial.index]
            self._denied(qname, level)
            raise RateLimitedError(
                f"rate limit {qname} reached for {_label(level, who)}: limit {limit}, "
                f"{denial.current} used in the window, this request needs {amount}; retry later",
                max(1.0, denial.retry_after_s),
            )
        return checks

    async def refund_tokens(self, charged: list[RateCheck], amount: int) -> None:
        """Give back tokens charged but not used (sampling charges max_tokens up front)."""
        if amount > 0 and charged:
            await self.store.adjust(charged, -amount)

    # -- reporting ---------------------------------------------------------------------------
    async def usage(self, who: Principal, db: Session) -> dict[str, dict]:
        """Current use and limits per quota at each level (for the admin API)."""
        limits = self.limits(who, db)
        out: dict[str, dict] = {}
        for level, subject in self._levels(who):
            cur: dict[str, dict] = {}
            tc = await self.store.gauge(f"{level}:{subject}:training_clients")
            ck = await self.store.gauge(f"{level}:{subject}:checkpoints")
            sm = await self.store.gauge(f"{level}:{subject}:samples")
            gauges = {
                "max_training_clients": len(tc),
                "max_checkpoints": len(ck),
                "max_checkpoint_bytes": sum(ck.values()),
                "max_concurrent_samples": len(sm),
            }
            for name, value in gauges.items():
                cur[name] = {"current": value, "limit": limits.get(level, name)}
            checks, meta = self._rate_checks(who, "train", limits)
            c2, m2 = self._rate_checks(who, "sample", limits)
            for check, (lv, qname, limit) in zip(checks + c2, meta + m2, strict=True):
                if lv == level:
                    cur[qname] = {"current": await self.store.used(check), "limit": limit}
            cur["max_lora_rank"] = {"current": None, "limit": limits.get(level, "max_lora_rank")}
            out[level] = cur
        return out

    async def aclose(self) -> None:
        await self.store.aclose()


async def get_quotas(request: Request) -> Quotas:
    services: AppServices = request.app.state.services
    return services.quotas


QuotasDep = Annotated[Quotas, Depends(get_quotas)]


def build_quotas(config: ServerConfig, db_engine: Engine, redis_url: str | None) -> Quotas:
    """The replica's quota service: Redis-backed when ``redis_url`` (see
    `gateway.config.effective_redis_url`), else in process. Quota names were validated with the
    config."""
    defaults = dict(config.gateway.default_user_quotas)
    # The top-level knob is the per-user default for concurrent sampling requests.
    if config.max_concurrent_samples_per_user and "max_concurrent_samples" not in defaults:
        defaults["max_concurrent_samples"] = config.max_concurrent_samples_per_user
    store = RedisQuotaStore(redis_url) if redis_url else MemoryQuotaStore()
    return Quotas(store, db_engine, default_user_quotas=defaults)
