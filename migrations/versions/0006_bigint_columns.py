"""training_runs.seed and checkpoints.size_bytes: 64-bit integers (were 32-bit on Postgres).

A Tinker ``LoraConfig(seed=...)`` past 2**31 - 1 (a millisecond timestamp, a 64-bit random seed)
was a 500 on Postgres ("integer out of range"); the wire now bounds seeds to a signed 64-bit
integer (what torch's generators and this column take). A checkpoint of 2 GiB or more (a
rank-64 LoRA of a 70B model with its AdamW state is ~5 GB) failed to record its size the same
way. SQLite's INTEGER is 64-bit already. Mirrors ``gateway/db/tables.py`` exactly (no
autogenerate drift).

Revision ID: 0006_bigint_columns
Revises: 0005_request_traces
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006_bigint_columns"
down_revision: str | None = "0005_request_traces"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

COLUMNS = (("training_runs", "seed"), ("checkpoints", "size_bytes"))


def upgrade() -> None:
    for table, column in COLUMNS:
        with op.batch_alter_table(table) as batch:
            batch.alter_column(
                column, existing_type=sa.Integer(), type_=sa.BigInteger(), existing_nullable=False
            )


def downgrade() -> None:
    # On Postgres this fails while a value past 32 bits is stored: the DB refuses to truncate it.
    for table, column in COLUMNS:
        with op.batch_alter_table(table) as batch:
            batch.alter_column(
                column, existing_type=sa.BigInteger(), type_=sa.Integer(), existing_nullable=False
            )
