"""Checked outputs' figures of each job.

Revision ID: 0014
Revises: 0013
Create Date: 2027-04-05

Three columns on ``jobs``: ``invalid_output`` (lines whose last answer failed the job's
check; part of ``failed``), ``output_retries`` (answers tried again) and ``retry_tokens``
(those discarded answers' prompt + completion tokens).
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0014"
down_revision = "0013"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("invalid_output", sa.Integer(), nullable=False, server_default="0"))
        batch.add_column(sa.Column("output_retries", sa.Integer(), nullable=False, server_default="0"))
        batch.add_column(sa.Column("retry_tokens", sa.BigInteger(), nullable=False, server_default="0"))


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("retry_tokens")
        batch.drop_column("output_retries")
        batch.drop_column("invalid_output")
