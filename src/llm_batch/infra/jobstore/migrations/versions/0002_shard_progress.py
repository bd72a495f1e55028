"""Shard progress rows; the job's invalid count and usage.

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-01

One row per (job, shard), written by that shard's watcher; the job's live counts and usage
are set from the sum of its rows in the same transaction (docs/data-plane.md, "Live counts").
Columns spelled out (a migration is a frozen picture, it does not import the models).
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None

_JOB_COLUMNS = (
    ("invalid", sa.Integer(), "0"),
    ("prompt_tokens", sa.BigInteger(), "0"),
    ("completion_tokens", sa.BigInteger(), "0"),
    ("cached_prompt_tokens", sa.BigInteger(), None),
    ("reasoning_tokens", sa.BigInteger(), "0"),
    ("engine_seconds", sa.Float(), "0"),
    ("tokens_per_s", sa.Float(), "0"),
)


def upgrade() -> None:
    op.create_table(
        "shard_progress",
        sa.Column("job_id", sa.String(64), primary_key=True),
        sa.Column("shard", sa.Integer(), primary_key=True),
        sa.Column("total", sa.Integer(), nullable=False),
        sa.Column("done", sa.Integer(), nullable=False),
        sa.Column("succeeded", sa.Integer(), nullable=False),
        sa.Column("failed", sa.Integer(), nullable=False),
        sa.Column("prompt_tokens", sa.BigInteger(), nullable=False),
        sa.Column("completion_tokens", sa.BigInteger(), nullable=False),
        sa.Column("cached_prompt_tokens", sa.BigInteger(), nullable=False),
        sa.Column("engine_seconds", sa.Float(), nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("reason", sa.Text()),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
    )
    # Existing jobs: a known 0 for the counters, unknown (NULL) for the details.
    for name, type_, default in _JOB_COLUMNS:
        op.add_column("jobs", sa.Column(name, type_, nullable=default is None,
                                        server_default=None if default is None else sa.text(default)))


def downgrade() -> None:
    for name, _, _ in reversed(_JOB_COLUMNS):
        with op.batch_alter_table("jobs") as batch:
            batch.drop_column(name)
    op.drop_table("shard_progress")
