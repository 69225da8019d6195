"""custom_losses: the traced losses a session uploads with create_custom_loss (server-side custom
losses, Tinker's ``loss_fn="custom"``).

Mirrors ``gateway/db/tables.py`` exactly (no autogenerate drift).

Revision ID: 0004_custom_losses
Revises: 0003_train_vision
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004_custom_losses"
down_revision: str | None = "0003_train_vision"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "custom_losses",
        sa.Column("id", sa.String(length=128), nullable=False),
        sa.Column("session_id", sa.String(), nullable=False),
        sa.Column("user_id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=128), nullable=False),
        sa.Column("inputs", sa.JSON(), nullable=False),
        sa.Column("nodes", sa.JSON(), nullable=False),
        sa.Column("fingerprint", sa.String(length=64), nullable=False),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.ForeignKeyConstraint(["session_id"], ["sessions.id"]),
        sa.ForeignKeyConstraint(["user_id"], ["users.id"]),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index("ix_custom_losses_session_id", "custom_losses", ["session_id"], unique=False)
    op.create_index("ix_custom_losses_user_id", "custom_losses", ["user_id"], unique=False)


def downgrade() -> None:
    op.drop_index("ix_custom_losses_user_id", table_name="custom_losses")
    op.drop_index("ix_custom_losses_session_id", table_name="custom_losses")
    op.drop_table("custom_losses")
