"""Owners' own LoRA adapters.

Revision ID: 0011
Revises: 0010
Create Date: 2027-03-15

One table, ``adapters``: an adapter an owner uploaded (``POST /v1/adapters``), the registered
generate model it adapts (``base``), where its two files are in storage (``uri``, a prefix
ending in ``/``), its LoRA rank and size. One name per owner (deleting removes the row).
Columns spelled out (a migration is a frozen picture).
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "adapters",
        sa.Column("id", sa.String(64), primary_key=True),
        sa.Column("owner", sa.String(256), nullable=False),
        sa.Column("name", sa.String(64), nullable=False),
        sa.Column("base", sa.String(256), nullable=False),
        sa.Column("uri", sa.Text(), nullable=False),
        sa.Column("rank", sa.Integer(), nullable=False),
        sa.Column("bytes", sa.BigInteger(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.UniqueConstraint("owner", "name", name="uq_adapters_owner_name"),
    )


def downgrade() -> None:
    op.drop_table("adapters")
