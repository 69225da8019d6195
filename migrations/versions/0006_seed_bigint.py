"""training_runs.seed: a 64-bit integer (was 32-bit on Postgres).

A Tinker ``LoraConfig(seed=...)`` past 2**31 - 1 (a millisecond timestamp, a 64-bit random seed)
was a 500 on Postgres ("integer out of range"); the wire now bounds seeds to a signed 64-bit
integer (what torch.manual_seed and this column take) and the column holds all of it. Mirrors
``gateway/db/tables.py`` exactly (no autogenerate drift).

Revision ID: 0006_seed_bigint
Revises: 0005_request_traces
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006_seed_bigint"
down_revision: str | None = "0005_request_traces"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("training_runs") as batch:
        batch.alter_column(
            "seed", existing_type=sa.Integer(), type_=sa.BigInteger(), existing_nullable=False
        )


def downgrade() -> None:
    # On Postgres this fails while a seed past 32 bits is stored: the DB refuses to truncate it.
    with op.batch_alter_table("training_runs") as batch:
        batch.alter_column(
            "seed", existing_type=sa.BigInteger(), type_=sa.Integer(), existing_nullable=False
        )
