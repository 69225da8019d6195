"""DB tables of the hosted-service layer: organizations, quota limits, the usage ledger and the
audit log (SQLModel, ``table=True``; schema owned by migration ``0002_accounts``).

Users (``users.org_id``) belong to one organization. A quota limit row sets one named limit for an
organization (``subject_type="org"``) or overrides it for one user (``subject_type="user"``).
Usage is kept in hourly buckets per (hour, user, session, base model, kind). Audit events never
hold a key, only its display prefix.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from pydantic import NaiveDatetime
from sqlalchemy import JSON, BigInteger, Column, Float, UniqueConstraint
from sqlmodel import Field, SQLModel


def utcnow() -> datetime:
    """Naive UTC now (same convention as `gateway.tables.utcnow`; not imported from there so the
    two table modules can import each other in either order)."""
    return datetime.now(UTC).replace(tzinfo=None)


class OrganizationRow(SQLModel, table=True):
    __tablename__ = "organizations"

    id: int | None = Field(default=None, primary_key=True)
    name: str = Field(index=True, unique=True, max_length=128)
    created_at: NaiveDatetime = Field(default_factory=utcnow)
    disabled_at: NaiveDatetime | None = None


class QuotaLimitRow(SQLModel, table=True):
    """One limit: ``value`` of quota ``name`` for an org or a user (see `gateway.quotas.limits`)."""

    __tablename__ = "quota_limits"
    __table_args__ = (
        UniqueConstraint("subject_type", "subject_id", "name", name="uq_quota_subject_name"),
    )

    id: int | None = Field(default=None, primary_key=True)
    subject_type: str = Field(max_length=8)  # "org" | "user"
    subject_id: int = Field(index=True)
    name: str = Field(max_length=64)
    value: int = Field(sa_column=Column(BigInteger, nullable=False))
    updated_at: NaiveDatetime = Field(default_factory=utcnow)


class UsageBucketRow(SQLModel, table=True):
    """Usage of one kind in one UTC hour. ``kind``: training | sampling_prefill |
    sampling_sample | storage (``gigabyte_hours``) | checkpoint (``quantity`` = saves)."""

    __tablename__ = "usage_buckets"
    __table_args__ = (
        UniqueConstraint(
            "bucket_start", "user_id", "session_id", "base_model", "kind", name="uq_usage_bucket"
        ),
    )

    id: int | None = Field(default=None, primary_key=True)
    bucket_start: NaiveDatetime = Field(index=True)
    org_id: int | None = Field(default=None, index=True)
    user_id: int = Field(index=True)
    # "" rather than NULL so the unique constraint (and the upsert) works on every database.
    session_id: str = Field(default="", max_length=64)
    base_model: str = Field(default="", max_length=256)
    kind: str = Field(max_length=32)
    quantity: int = Field(default=0, sa_column=Column(BigInteger, nullable=False))
    gigabyte_hours: float = Field(default=0.0, sa_column=Column(Float, nullable=False))


class AuditEventRow(SQLModel, table=True):
    """A security or admin event: ``<resource>_<action>`` (key_created, key_revoked,
    quota_changed, access_denied, ...)."""

    __tablename__ = "audit_events"

    id: int | None = Field(default=None, primary_key=True)
    created_at: NaiveDatetime = Field(default_factory=utcnow, index=True)
    event: str = Field(max_length=64, index=True)
    org_id: int | None = Field(default=None, index=True)
    actor_user_id: int | None = None
    actor_key_prefix: str | None = Field(default=None, max_length=16)
    details: dict[str, Any] = Field(default_factory=dict, sa_column=Column(JSON, nullable=False))


import gateway.tables  # noqa: E402,F401  (users / api_keys must be on the metadata too)
