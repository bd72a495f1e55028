"""A small progress history per job (the UI's plots of counts and tokens/s over time).

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-01

One row per (job, instant), appended by ``JobStore.report_shard`` in its transaction at most
every few seconds per job, thinned to about 500 rows per job. Columns spelled out (a
migration is a frozen picture, it does not import the models).
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "progress_history",
        sa.Column("job_id", sa.String(64), primary_key=True),
        sa.Column("at", sa.DateTime(timezone=True), primary_key=True),
        sa.Column("total", sa.Integer(), nullable=False),
        sa.Column("completed", sa.Integer(), nullable=False),
        sa.Column("succeeded", sa.Integer(), nullable=False),
        sa.Column("failed", sa.Integer(), nullable=False),
        sa.Column("completion_tokens", sa.BigInteger(), nullable=False),
        sa.Column("tokens_per_s", sa.Float(), nullable=False),
    )


def downgrade() -> None:
    op.drop_table("progress_history")
