"""request_traces: one row per finished request of a session, for its trace export.

Mirrors ``gateway/db/tables.py`` exactly (no autogenerate drift).

Revision ID: 0005_request_traces
Revises: 0004_custom_losses
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005_request_traces"
down_revision: str | None = "0004_custom_losses"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "request_traces",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("session_id", sa.String(length=64), nullable=False),
        sa.Column("user_id", sa.Integer(), nullable=False),
        sa.Column("request_id", sa.String(length=64), nullable=False),
        sa.Column("kind", sa.String(length=32), nullable=False),
        sa.Column("target", sa.String(length=128), nullable=False),
        sa.Column("submitted", sa.Float(), nullable=False),
        sa.Column("finished", sa.Float(), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("error_category", sa.String(length=16), nullable=True),
        sa.Column("error", sa.String(length=300), nullable=True),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index("ix_request_traces_session_id", "request_traces", ["session_id"])
    op.create_index("ix_request_traces_user_id", "request_traces", ["user_id"])


def downgrade() -> None:
    op.drop_index("ix_request_traces_user_id", table_name="request_traces")
    op.drop_index("ix_request_traces_session_id", table_name="request_traces")
    op.drop_table("request_traces")
