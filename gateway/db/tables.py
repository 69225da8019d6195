"""Every DB table (SQLModel, ``table=True``), in one module so ``SQLModel.metadata`` (Alembic's
target) always holds all of them. Alembic in ``migrations/`` owns the schema.

Tinker state: users, API keys, sessions, training runs, checkpoints, samplers. Hosted-service
state (migration ``0002_accounts``): organizations (``users.org_id``), quota limits (one named
limit for an org, ``subject_type="org"``, or a user override, ``subject_type="user"``), the usage
ledger (hourly buckets per hour, user, session, base model, kind) and the audit log (a key's
display prefix at most, never the key). A session's server-side custom losses (migration
``0004_custom_losses``). Session traces (``0005_request_traces``): one row per finished request
of a session (kind, target, times, status; never a payload). Stability records
(``0007_stability_records``): what a sampler recorded for one sampled sequence of a session
(``record_stability_info``), read by ``stable_reinforce`` training requests.

These are neither wire schemas nor engine types. Timestamps are stored as naive UTC: every
timestamp column is annotated ``NaiveDatetime`` because sqlmodel >= 0.0.50 maps a plain ``datetime``
to ``UTCDateTime``, which rejects naive values on insert.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from pydantic import NaiveDatetime
from sqlalchemy import JSON, BigInteger, Column, Float, LargeBinary, UniqueConstraint
from sqlmodel import Field, SQLModel

# Each ``__tablename__ = "..."`` below carries ``# pyright: ignore[reportAssignmentType]``:
# SQLModel declares ``__tablename__`` as a SQLAlchemy ``declared_attr``, so pyright rejects a plain
# string, which SQLAlchemy and SQLModel accept (and document).


def utcnow() -> datetime:
    """Naive UTC now (SQLite keeps no time zone; every column is UTC by convention)."""
    return datetime.now(UTC).replace(tzinfo=None)


class UserRow(SQLModel, table=True):
    __tablename__ = "users"  # pyright: ignore[reportAssignmentType]

    id: int | None = Field(default=None, primary_key=True)
    name: str = Field(index=True, unique=True, max_length=128)
    is_admin: bool = False
    created_at: NaiveDatetime = Field(default_factory=utcnow)
    # Accounts (migration 0002_accounts): the user's organization and a soft disable.
    org_id: int | None = Field(default=None, foreign_key="organizations.id", index=True)
    disabled_at: NaiveDatetime | None = None


class ApiKeyRow(SQLModel, table=True):
    """An API key. Only the sha256 hex digest of the full key is stored, plus a short prefix for
    display (``tml-`` and 6 more characters)."""

    __tablename__ = "api_keys"  # pyright: ignore[reportAssignmentType]

    id: int | None = Field(default=None, primary_key=True)
    user_id: int = Field(foreign_key="users.id", index=True)
    digest: str = Field(index=True, unique=True, max_length=64)
    prefix: str = Field(max_length=16)
    scope: str = Field(default="user", max_length=16)  # "user" | "admin"
    created_at: NaiveDatetime = Field(default_factory=utcnow)
    revoked_at: NaiveDatetime | None = None
    # Accounts (migration 0002_accounts): a label and an optional expiry.
    name: str | None = Field(default=None, max_length=128)
    expires_at: NaiveDatetime | None = None


class SessionRow(SQLModel, table=True):
    __tablename__ = "sessions"  # pyright: ignore[reportAssignmentType]

    id: str = Field(primary_key=True, max_length=64)
    user_id: int = Field(foreign_key="users.id", index=True)
    sdk_version: str | None = Field(default=None, max_length=32)
    tags: list[str] = Field(default_factory=list, sa_column=Column(JSON, nullable=False))
    user_metadata: dict[str, Any] = Field(
        default_factory=dict, sa_column=Column(JSON, nullable=False)
    )
    project_id: str | None = Field(default=None, max_length=128)
    display_name: str | None = Field(default=None, max_length=256)
    created_at: NaiveDatetime = Field(default_factory=utcnow)
    last_heartbeat_at: NaiveDatetime = Field(default_factory=utcnow)
    finished_at: NaiveDatetime | None = None
    finish_reason: str | None = Field(default=None, max_length=32)


class TrainingRunRow(SQLModel, table=True):
    """One Tinker training client (= one adapter).

    ``id`` is ``{session_id}:train:{model_seq_id}``."""

    __tablename__ = "training_runs"  # pyright: ignore[reportAssignmentType]

    id: str = Field(primary_key=True, max_length=128)
    session_id: str = Field(foreign_key="sessions.id", index=True)
    user_id: int = Field(foreign_key="users.id", index=True)
    base_model: str = Field(max_length=256)
    lora_rank: int
    train_attn: bool = True
    train_mlp: bool = True
    train_unembed: bool = True
    #: LoRA on a VL model's vision tower too (native clients opt in; Tinker's LoraConfig has no
    #: such switch)
    train_vision: bool = False
    #: 64-bit: a Tinker LoraConfig seed is any int the wire allows (a signed 64-bit one)
    seed: int = Field(default=0, sa_column=Column(BigInteger, nullable=False))
    user_metadata: dict[str, Any] = Field(
        default_factory=dict, sa_column=Column(JSON, nullable=False)
    )
    created_at: NaiveDatetime = Field(default_factory=utcnow)
    last_request_time: NaiveDatetime = Field(default_factory=utcnow)

    def adapter_shape(self) -> dict[str, Any]:
        """The fields a new run built from this one's adapter keeps: base model, rank, targets,
        seed (copy_weights, load_weights into a new model)."""
        return {
            "base_model": self.base_model,
            "lora_rank": self.lora_rank,
            "train_attn": self.train_attn,
            "train_mlp": self.train_mlp,
            "train_unembed": self.train_unembed,
            "train_vision": self.train_vision,
            "seed": self.seed,
        }


class CustomLossRow(SQLModel, table=True):
    """A traced loss uploaded by a session (``create_custom_loss``): ``id`` is
    ``{session_id}:loss:{custom_loss_seq_id}``, usable only by that session's training clients
    (``loss_fn="custom"``, ``loss_fn_config={"loss_id": id}``). ``inputs`` are ``[name, rank]``
    pairs, ``nodes`` the SDK's graph nodes, checked by the engine before the row is written;
    ``fingerprint`` tells a retry of the same upload from a different loss under the same id."""

    __tablename__ = "custom_losses"  # pyright: ignore[reportAssignmentType]

    id: str = Field(primary_key=True, max_length=128)
    session_id: str = Field(foreign_key="sessions.id", index=True)
    user_id: int = Field(foreign_key="users.id", index=True)
    name: str = Field(max_length=128)
    inputs: list[Any] = Field(default_factory=list, sa_column=Column(JSON, nullable=False))
    nodes: list[Any] = Field(default_factory=list, sa_column=Column(JSON, nullable=False))
    fingerprint: str = Field(max_length=64)
    created_at: NaiveDatetime = Field(default_factory=utcnow)


class CheckpointRow(SQLModel, table=True):
    """A saved checkpoint. ``kind`` is "training" (weights/), "sampler" (sampler_weights/) or
    "external" (external_weights/); ``storage_dir`` is server-side and never sent to clients."""

    __tablename__ = "checkpoints"  # pyright: ignore[reportAssignmentType]
    __table_args__ = (
        UniqueConstraint("run_id", "kind", "name", name="uq_checkpoint_run_kind_name"),
    )

    id: int | None = Field(default=None, primary_key=True)
    run_id: str = Field(foreign_key="training_runs.id", index=True, max_length=128)
    user_id: int = Field(foreign_key="users.id", index=True)
    kind: str = Field(max_length=16)
    name: str = Field(max_length=128)
    tinker_path: str = Field(unique=True, max_length=512)
    storage_dir: str = Field(max_length=1024)
    #: 64-bit: a LoRA of a large model with its AdamW state passes 2 GiB
    size_bytes: int = Field(default=0, sa_column=Column(BigInteger, nullable=False))
    public: bool = False
    ephemeral: bool = False
    user_metadata: dict[str, Any] = Field(
        default_factory=dict, sa_column=Column(JSON, nullable=False)
    )
    created_at: NaiveDatetime = Field(default_factory=utcnow)
    expires_at: NaiveDatetime | None = None


class SamplingSessionRow(SQLModel, table=True):
    """A sampler: ``id`` is ``{session_id}:sample:{sampling_session_seq_id}``."""

    __tablename__ = "sampling_sessions"  # pyright: ignore[reportAssignmentType]

    id: str = Field(primary_key=True, max_length=128)
    session_id: str = Field(foreign_key="sessions.id", index=True)
    user_id: int = Field(foreign_key="users.id", index=True)
    base_model: str = Field(max_length=256)
    model_path: str | None = Field(default=None, max_length=512)
    adapter_dir: str | None = Field(default=None, max_length=1024)
    created_at: NaiveDatetime = Field(default_factory=utcnow)


class StabilityRecordRow(SQLModel, table=True):
    """One sequence a sampling client with ``record_stability_info`` returned: its prompt, its
    sampled tokens and the sampler's own logprob of each (int32 / int32 / float32 little-endian
    bytes), under the ``sequence_id`` the client got. Usable only by training requests of the
    same client session; ``expires_at`` moves a day on at each use (gateway/tinker_api/
    stability.py). ``id`` orders a session's records for evicting the oldest."""

    __tablename__ = "stability_records"  # pyright: ignore[reportAssignmentType]

    id: int | None = Field(default=None, primary_key=True)
    sequence_id: str = Field(unique=True, max_length=64)
    session_id: str = Field(index=True, max_length=64)
    prompt: bytes = Field(sa_column=Column(LargeBinary, nullable=False))
    tokens: bytes = Field(sa_column=Column(LargeBinary, nullable=False))
    logprobs: bytes = Field(sa_column=Column(LargeBinary, nullable=False))
    created_at: NaiveDatetime = Field(default_factory=utcnow)
    expires_at: NaiveDatetime = Field(index=True)


# -- hosted-service layer (accounts, quotas, usage, audit) --------------------------------


class OrganizationRow(SQLModel, table=True):
    __tablename__ = "organizations"  # pyright: ignore[reportAssignmentType]

    id: int | None = Field(default=None, primary_key=True)
    name: str = Field(index=True, unique=True, max_length=128)
    created_at: NaiveDatetime = Field(default_factory=utcnow)
    disabled_at: NaiveDatetime | None = None


class QuotaLimitRow(SQLModel, table=True):
    """One limit: ``value`` of quota ``name`` for an org or a user (see `gateway.quotas.limits`)."""

    __tablename__ = "quota_limits"  # pyright: ignore[reportAssignmentType]
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

    __tablename__ = "usage_buckets"  # pyright: ignore[reportAssignmentType]
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

    __tablename__ = "audit_events"  # pyright: ignore[reportAssignmentType]

    id: int | None = Field(default=None, primary_key=True)
    created_at: NaiveDatetime = Field(default_factory=utcnow, index=True)
    event: str = Field(max_length=64, index=True)
    org_id: int | None = Field(default=None, index=True)
    actor_user_id: int | None = None
    actor_key_prefix: str | None = Field(default=None, max_length=16)
    details: dict[str, Any] = Field(default_factory=dict, sa_column=Column(JSON, nullable=False))


class RequestTraceRow(SQLModel, table=True):
    """One finished request of a session, for its trace export: what ran (``kind``:
    forward_backward, optim_step, sample, save...), on which model or sampler (``target``), when
    it was submitted and finished (UNIX seconds), and how it ended. Never a payload, a key or a
    result: ``error`` is the failed future's message (at most 300 characters)."""

    __tablename__ = "request_traces"  # pyright: ignore[reportAssignmentType]

    id: int | None = Field(default=None, primary_key=True)
    session_id: str = Field(index=True, max_length=64)
    user_id: int = Field(index=True)
    request_id: str = Field(max_length=64)
    kind: str = Field(max_length=32)
    target: str = Field(max_length=128)
    submitted: float = Field(sa_column=Column(Float, nullable=False))
    finished: float = Field(sa_column=Column(Float, nullable=False))
    status: str = Field(max_length=16)  # "ok" | "failed"
    error_category: str | None = Field(default=None, max_length=16)
    error: str | None = Field(default=None, max_length=300)
