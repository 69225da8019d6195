"""training_runs.train_vision: LoRA on a vision-language model's vision tower too (opt-in).

Mirrors ``gateway/db/tables.py`` exactly (no autogenerate drift). Existing runs get false: before
this column no adapter trained the vision tower.

Revision ID: 0003_train_vision
Revises: 0002_accounts
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003_train_vision"
down_revision: str | None = "0002_accounts"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("training_runs") as batch:
        batch.add_column(
            sa.Column("train_vision", sa.Boolean(), nullable=False, server_default=sa.false())
        )


def downgrade() -> None:
    with op.batch_alter_table("training_runs") as batch:
        batch.drop_column("train_vision")
