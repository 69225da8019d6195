"""Quota names and how a caller's effective limits are resolved.

Owns the list of quotas (`QUOTAS`), validation of names and values, and `resolve_limits`: each
quota is checked at two levels, independently:

* organization: a row ``("org", org_id, name)`` caps the whole organization (all its users
  together; for ``max_lora_rank``, every user of it);
* user: a row ``("user", user_id, name)`` is the user's override; without one the server
  config's ``gateway.default_user_quotas`` applies (and, for ``max_concurrent_samples``, the
  legacy ``max_concurrent_samples_per_user``).

A missing limit means unlimited at that level.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from sqlmodel import Session, and_, or_, select

from gateway.db.tables import QuotaLimitRow
from gateway.errors import InvalidRequestError

QUOTAS: dict[str, str] = {
    "max_training_clients": "training clients (models) held at once",
    "max_lora_rank": "largest LoRA rank of a new training client",
    "max_concurrent_samples": "sampling requests in flight at once",
    "train_tokens_per_minute": "forward/backward tokens per sliding minute",
    "train_tokens_per_day": "forward/backward tokens per sliding 24 hours",
    "sample_tokens_per_minute": "prompt + max sampled tokens per sliding minute",
    "sample_tokens_per_day": "prompt + max sampled tokens per sliding 24 hours",
    "max_checkpoint_bytes": "bytes of saved checkpoints kept",
    "max_checkpoints": "number of saved checkpoints kept",
}
SUBJECT_TYPES = ("org", "user")


def check_quota_name(name: str, field: str = "name") -> str:
    if name not in QUOTAS:
        raise InvalidRequestError(f"{field}: unknown quota {name!r}; known: {sorted(QUOTAS)}")
    return name


def check_quota_value(value: object, field: str = "value") -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InvalidRequestError(f"{field}: a quota limit must be an integer >= 0")
    return value


@dataclass(frozen=True)
class Limits:
    org: dict[str, int] = field(default_factory=dict)
    user: dict[str, int] = field(default_factory=dict)

    def get(self, level: str, name: str) -> int | None:
        return (self.org if level == "org" else self.user).get(name)


def resolve_limits(
    session: Session, org_id: int | None, user_id: int, defaults: dict[str, int]
) -> Limits:
    cond = and_(QuotaLimitRow.subject_type == "user", QuotaLimitRow.subject_id == user_id)
    if org_id is not None:
        cond = or_(
            cond, and_(QuotaLimitRow.subject_type == "org", QuotaLimitRow.subject_id == org_id)
        )
    org: dict[str, int] = {}
    user: dict[str, int] = dict(defaults)
    for row in session.exec(select(QuotaLimitRow).where(cond)):
        (org if row.subject_type == "org" else user)[row.name] = row.value
    return Limits(org=org, user=user)


def set_limit(
    session: Session, subject_type: str, subject_id: int, name: str, value: int | None
) -> tuple[int | None, int | None]:
    """Set (or with None, remove) one limit; returns (old, new). Flushes; the caller commits."""
    if subject_type not in SUBJECT_TYPES:
        raise InvalidRequestError(f"subject_type: must be one of {list(SUBJECT_TYPES)}")
    check_quota_name(name)
    if value is not None:
        check_quota_value(value)
    row = session.exec(
        select(QuotaLimitRow).where(
            QuotaLimitRow.subject_type == subject_type,
            QuotaLimitRow.subject_id == subject_id,
            QuotaLimitRow.name == name,
        )
    ).first()
    old = row.value if row is not None else None
    if value is None:
        if row is not None:
            session.delete(row)
    elif row is None:
        session.add(
            QuotaLimitRow(subject_type=subject_type, subject_id=subject_id, name=name, value=value)
        )
    else:
        from gateway.db.tables import utcnow

        row.value, row.updated_at = value, utcnow()
        session.add(row)
    session.flush()
    return old, value


def limits_of(session: Session, subject_type: str, subject_id: int) -> dict[str, int]:
    rows = session.exec(
        select(QuotaLimitRow).where(
            QuotaLimitRow.subject_type == subject_type, QuotaLimitRow.subject_id == subject_id
        )
    )
    return {r.name: r.value for r in rows}
