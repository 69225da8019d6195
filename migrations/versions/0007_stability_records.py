"""stability_records: what a sampler recorded for each sequence sampled with
``record_stability_info`` (read by ``stable_reinforce`` training requests through provenance spans).

Mirrors ``gateway/db/tables.py`` exactly (no autogenerate drift).

Revision ID: 0007_stability_records
Revises: 0006_bigint_columns
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0007_stability_records"
down_revision: str | None = "0006_bigint_columns"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "stability_records",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("sequence_id", sa.String(length=64), nullable=False),
        sa.Column("session_id", sa.String(length=64), nullable=False),
        sa.Column("prompt", sa.LargeBinary(), nullable=False),
        sa.Column("tokens", sa.LargeBinary(), nullable=False),
        sa.Column("logprobs", sa.LargeBinary(), nullable=False),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.Column("expires_at", sa.DateTime(), nullable=False),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("sequence_id"),
    )
    op.create_index("ix_stability_records_session_id", "stability_records", ["session_id"])
    op.create_index("ix_stability_records_expires_at", "stability_records", ["expires_at"])


def downgrade() -> None:
    op.drop_index("ix_stability_records_expires_at", table_name="stability_records")
    op.drop_index("ix_stability_records_session_id", table_name="stability_records")
    op.drop_table("stability_records")
