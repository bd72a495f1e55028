"""Idempotency keys: retry-safe creates and uploads (``Idempotency-Key`` header).

Revision ID: 0005
Revises: 0004
Create Date: 2027-01-10

One row per (owner, key): the primary key is the unique constraint that lets exactly one
of many concurrent requests reserve a key. It holds the route and the body's sha256 of the
first request, then its response (status, content type, body) to replay. Housekeeping
deletes rows older than the retention (24 hours at least).

Output expiry needs no column here: ``files.expires_at`` exists since 0001 (nullable,
unused until now); a batch's requested output expiry is kept in the job's metadata
(``metadata["_output_expires_after_s"]``, see steps._record_file).
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "idempotency_keys",
        sa.Column("owner", sa.String(256), primary_key=True),
        sa.Column("key", sa.String(255), primary_key=True),
        sa.Column("route", sa.String(256), nullable=False),
        sa.Column("fingerprint", sa.String(64), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("locked_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("status_code", sa.Integer()),
        sa.Column("content_type", sa.String(128)),
        sa.Column("response_body", sa.Text()),
        sa.Column("completed_at", sa.DateTime(timezone=True)),
    )
    op.create_index("ix_idempotency_keys_created_at", "idempotency_keys", ["created_at"])


def downgrade() -> None:
    op.drop_index("ix_idempotency_keys_created_at", table_name="idempotency_keys")
    op.drop_table("idempotency_keys")
