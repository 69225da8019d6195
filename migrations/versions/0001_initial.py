"""Initial schema: users, api_keys, sessions, training_runs, checkpoints, sampling_sessions.

Mirrors ``gateway/db/tables.py`` exactly (types, nullability, ``ix_*`` indexes, unique constraints),
so ``alembic revision --autogenerate`` finds no drift (checked by tests/gateway/test_migrations.py).

Revision ID: 0001
Revises:
Create Date: 2025-01-01 00:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "users",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=128), nullable=False),
        sa.Column("is_admin", sa.Boolean(), nullable=False),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index("ix_users_name", "users", ["name"], unique=True)

    op.create_table(
        "api_keys",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("user_id", sa.Integer(), nullable=False),
        sa.Column("digest", sa.String(length=64), nullable=False),
        sa.Column("prefix", sa.String(length=16), nullable=False),
        sa.Column("scope", sa.String(length=16), nullable=False),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.Column("revoked_at", sa.DateTime(), nullable=True),
        sa.ForeignKeyConstraint(["user_id"], ["users.id"]),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index("ix_api_keys_digest", "api_keys", ["digest"], unique=True)
    op.create_index("ix_api_keys_user_id", "api_keys", ["user_id"], unique=False)

    op.create_table(
        "sessions",
        sa.Column("id", sa.String(length=64), nullable=False),
        sa.Column("user_id", sa.Integer(), nullable=False),
        sa.Column("sdk_version", sa.String(length=32), nullable=True),
        sa.Column("tags", sa.JSON(), nullable=False),
        sa.Column("user_metadata", sa.JSON(), nullable=False),
        sa.Column("project_id", sa.String(length=128), nullable=True),
        sa.Column("display_name", sa.String(length=256), nullable=True),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.Column("last_heartbeat_at", sa.DateTime(), nullable=False),
        sa.Column("finished_at", sa.DateTime(), nullable=True),
        sa.Column("finish_reason", sa.String(length=32), nullable=True),
        sa.ForeignKeyConstraint(["user_id"], ["users.id"]),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index("ix_sessions_user_id", "sessions", ["user_id"], unique=False)

    op.create_table(
        "training_runs",
        sa.Column("id", sa.String(length=128), nullable=False),
        sa.Column("session_id", sa.String(), nullable=False),
        sa.Column("user_id", sa.Integer(), nullable=False),
        sa.Column("base_model", sa.String(length=256), nullable=False),
        sa.Column("lora_rank", sa.Integer(), nullable=False),
        sa.Column("train_attn", sa.Boolean(), nullable=False),
        sa.Column("train_mlp", sa.Boolean(), nullable=False),
        sa.Column("train_unembed", sa.Boolean(), nullable=False),
        sa.Column("seed", sa.Integer(), nullable=False),
        sa.Column("user_metadata", sa.JSON(), nullable=False),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.Column("last_request_time", sa.DateTime(), nullable=False),
        sa.ForeignKeyConstraint(["session_id"], ["sessions.id"]),
        sa.ForeignKeyConstraint(["user_id"], ["users.id"]),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index("ix_training_runs_session_id", "training_runs", ["session_id"], unique=False)
    op.create_index("ix_training_runs_user_id", "training_runs", ["user_id"], unique=False)

    op.create_table(
        "sampling_sessions",
        sa.Column("id", sa.String(length=128), nullable=False),
        sa.Column("session_id", sa.String(), nullable=False),
        sa.Column("user_id", sa.Integer(), nullable=False),
        sa.Column("base_model", sa.String(length=256), nullable=False),
        sa.Column("model_path", sa.String(length=512), nullable=True),
        sa.Column("adapter_dir", sa.String(length=1024), nullable=True),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.ForeignKeyConstraint(["session_id"], ["sessions.id"]),
        sa.ForeignKeyConstraint(["user_id"], ["users.id"]),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index(
        "ix_sampling_sessions_session_id", "sampling_sessions", ["session_id"], unique=False
    )
    op.create_index("ix_sampling_sessions_user_id", "sampling_sessions", ["user_id"], unique=False)

    op.create_table(
        "checkpoints",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("run_id", sa.String(length=128), nullable=False),
        sa.Column("user_id", sa.Integer(), nullable=False),
        sa.Column("kind", sa.String(length=16), nullable=False),
        sa.Column("name", sa.String(length=128), nullable=False),
        sa.Column("tinker_path", sa.String(length=512), nullable=False),
        sa.Column("storage_dir", sa.String(length=1024), nullable=False),
        sa.Column("size_bytes", sa.Integer(), nullable=False),
        sa.Column("public", sa.Boolean(), nullable=False),
        sa.Column("ephemeral", sa.Boolean(), nullable=False),
        sa.Column("user_metadata", sa.JSON(), nullable=False),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.Column("expires_at", sa.DateTime(), nullable=True),
        sa.ForeignKeyConstraint(["run_id"], ["training_runs.id"]),
        sa.ForeignKeyConstraint(["user_id"], ["users.id"]),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("run_id", "kind", "name", name="uq_checkpoint_run_kind_name"),
        sa.UniqueConstraint("tinker_path"),
    )
    op.create_index("ix_checkpoints_run_id", "checkpoints", ["run_id"], unique=False)
    op.create_index("ix_checkpoints_user_id", "checkpoints", ["user_id"], unique=False)


def downgrade() -> None:
    op.drop_index("ix_checkpoints_user_id", table_name="checkpoints")
    op.drop_index("ix_checkpoints_run_id", table_name="checkpoints")
    op.drop_table("checkpoints")
    op.drop_index("ix_sampling_sessions_user_id", table_name="sampling_sessions")
    op.drop_index("ix_sampling_sessions_session_id", table_name="sampling_sessions")
    op.drop_table("sampling_sessions")
    op.drop_index("ix_training_runs_user_id", table_name="training_runs")
    op.drop_index("ix_training_runs_session_id", table_name="training_runs")
    op.drop_table("training_runs")
    op.drop_index("ix_sessions_user_id", table_name="sessions")
    op.drop_table("sessions")
    op.drop_index("ix_api_keys_user_id", table_name="api_keys")
    op.drop_index("ix_api_keys_digest", table_name="api_keys")
    op.drop_table("api_keys")
    op.drop_index("ix_users_name", table_name="users")
    op.drop_table("users")
