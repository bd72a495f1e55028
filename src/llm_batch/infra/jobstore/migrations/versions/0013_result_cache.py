"""The result cache's index, and each job's cache hits.

Revision ID: 0013
Revises: 0012
Create Date: 2027-03-29

A table, ``result_cache``: one row per cached answer (``owner``, ``key`` the request's content
address, ``job_id`` the job that computed it, ``uri`` the object holding the answer, its
size, tokens, when it was made and last used). Two columns on ``jobs``: ``result_cache_hits``
(lines answered from the cache) and ``result_cache_tokens`` (their prompt + completion
tokens). Columns spelled out (a migration is a frozen picture).
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "result_cache",
        sa.Column("owner", sa.String(256), primary_key=True),
        sa.Column("key", sa.String(64), primary_key=True),
        sa.Column("job_id", sa.String(128), nullable=False),
        sa.Column("uri", sa.Text(), nullable=False),
        sa.Column("bytes", sa.BigInteger(), nullable=False),
        sa.Column("prompt_tokens", sa.BigInteger(), nullable=False),
        sa.Column("completion_tokens", sa.BigInteger(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("used_at", sa.DateTime(timezone=True), nullable=False),
    )
    op.create_index("ix_result_cache_job_id", "result_cache", ["job_id"])
    op.create_index("ix_result_cache_created_at", "result_cache", ["created_at"])
    op.create_index("ix_result_cache_used_at", "result_cache", ["used_at"])
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("result_cache_hits", sa.Integer(), nullable=False, server_default="0"))
        batch.add_column(sa.Column("result_cache_tokens", sa.BigInteger(), nullable=False, server_default="0"))


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("result_cache_tokens")
        batch.drop_column("result_cache_hits")
    op.drop_table("result_cache")
