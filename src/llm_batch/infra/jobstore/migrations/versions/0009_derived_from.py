"""A job made from another (a retry of its failed lines, a rerun) names its source.

Revision ID: 0009
Revises: 0008
Create Date: 2027-02-03

Two nullable columns on ``jobs``: ``derived_from_id`` (the source job's id, indexed so the
source can list what was made from it) and ``derived_kind`` (``retry`` | ``rerun``).
Ordinary jobs keep both null.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("derived_from_id", sa.String(64), nullable=True))
        batch.add_column(sa.Column("derived_kind", sa.String(16), nullable=True))
        batch.create_index("ix_jobs_derived_from_id", ["derived_from_id"])


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.drop_index("ix_jobs_derived_from_id")
        batch.drop_column("derived_kind")
        batch.drop_column("derived_from_id")
