"""A job's estimate, kept beside what it really took.

Revision ID: 0012
Revises: 0011
Create Date: 2027-03-22

One nullable JSON column on ``jobs``: ``estimate``, what ``llm_batch.pipeline.estimate``
expected of the job when its input was validated (lines, prompt tokens, the most output
tokens, engine seconds from the measured tokens/s, expected start and end). Null for jobs
validated before this revision, and when nothing could be estimated.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("estimate", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("estimate")
