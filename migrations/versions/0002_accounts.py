"""Accounts: organizations, users.org_id / disabled_at, api_keys.name / expires_at, quota limits,
the hourly usage ledger and the audit log.

Mirrors ``gateway/db/tables.py`` exactly (no autogenerate drift).
Existing users are moved into an organization named "default".

Revision ID: 0002_accounts
Revises: 0001
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002_accounts"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "organizations",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=128), nullable=False),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.Column("disabled_at", sa.DateTime(), nullable=True),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index("ix_organizations_name", "organizations", ["name"], unique=True)

    with op.batch_alter_table("users") as batch:
        batch.add_column(sa.Column("org_id", sa.Integer(), nullable=True))
        batch.add_column(sa.Column("disabled_at", sa.DateTime(), nullable=True))
        batch.create_index("ix_users_org_id", ["org_id"], unique=False)
        batch.create_foreign_key("fk_users_org_id", "organizations", ["org_id"], ["id"])
    with op.batch_alter_table("api_keys") as batch:
        batch.add_column(sa.Column("name", sa.String(length=128), nullable=True))
        batch.add_column(sa.Column("expires_at", sa.DateTime(), nullable=True))

    # Existing users join a "default" organization (only if there are any).
    conn = op.get_bind()
    if conn.exec_driver_sql("SELECT count(*) FROM users").scalar():
        conn.execute(
            sa.text("INSERT INTO organizations (name, created_at) VALUES ('default', :now)"),
            {"now": _now()},
        )
        org_id = conn.exec_driver_sql(
            "SELECT id FROM organizations WHERE name = 'default'"
        ).scalar()
        conn.execute(sa.text("UPDATE users SET org_id = :o WHERE org_id IS NULL"), {"o": org_id})

    op.create_table(
        "quota_limits",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("subject_type", sa.String(length=8), nullable=False),
        sa.Column("subject_id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=64), nullable=False),
        sa.Column("value", sa.BigInteger(), nullable=False),
        sa.Column("updated_at", sa.DateTime(), nullable=False),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("subject_type", "subject_id", "name", name="uq_quota_subject_name"),
    )
    op.create_index("ix_quota_limits_subject_id", "quota_limits", ["subject_id"], unique=False)

    op.create_table(
        "usage_buckets",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("bucket_start", sa.DateTime(), nullable=False),
        sa.Column("org_id", sa.Integer(), nullable=True),
        sa.Column("user_id", sa.Integer(), nullable=False),
        sa.Column("session_id", sa.String(length=64), nullable=False),
        sa.Column("base_model", sa.String(length=256), nullable=False),
        sa.Column("kind", sa.String(length=32), nullable=False),
        sa.Column("quantity", sa.BigInteger(), nullable=False),
        sa.Column("gigabyte_hours", sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint(
            "bucket_start", "user_id", "session_id", "base_model", "kind", name="uq_usage_bucket"
        ),
    )
    op.create_index("ix_usage_buckets_bucket_start", "usage_buckets", ["bucket_start"])
    op.create_index("ix_usage_buckets_org_id", "usage_buckets", ["org_id"])
    op.create_index("ix_usage_buckets_user_id", "usage_buckets", ["user_id"])

    op.create_table(
        "audit_events",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.Column("event", sa.String(length=64), nullable=False),
        sa.Column("org_id", sa.Integer(), nullable=True),
        sa.Column("actor_user_id", sa.Integer(), nullable=True),
        sa.Column("actor_key_prefix", sa.String(length=16), nullable=True),
        sa.Column("details", sa.JSON(), nullable=False),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index("ix_audit_events_created_at", "audit_events", ["created_at"])
    op.create_index("ix_audit_events_event", "audit_events", ["event"])
    op.create_index("ix_audit_events_org_id", "audit_events", ["org_id"])


def _now():
    from datetime import UTC, datetime

    return datetime.now(UTC).replace(tzinfo=None)


def downgrade() -> None:
    op.drop_index("ix_audit_events_org_id", table_name="audit_events")
    op.drop_index("ix_audit_events_event", table_name="audit_events")
    op.drop_index("ix_audit_events_created_at", table_name="audit_events")
    op.drop_table("audit_events")
    op.drop_index("ix_usage_buckets_user_id", table_name="usage_buckets")
    op.drop_index("ix_usage_buckets_org_id", table_name="usage_buckets")
    op.drop_index("ix_usage_buckets_bucket_start", table_name="usage_buckets")
    op.drop_table("usage_buckets")
    op.drop_index("ix_quota_limits_subject_id", table_name="quota_limits")
    op.drop_table("quota_limits")
    with op.batch_alter_table("api_keys") as batch:
        batch.drop_column("expires_at")
        batch.drop_column("name")
    with op.batch_alter_table("users") as batch:
        batch.drop_constraint("fk_users_org_id", type_="foreignkey")
        batch.drop_index("ix_users_org_id")
        batch.drop_column("disabled_at")
        batch.drop_column("org_id")
    op.drop_index("ix_organizations_name", table_name="organizations")
    op.drop_table("organizations")
