"""Initial schema: jobs, files, api_keys.

Revision ID: 0001
Revises:
Create Date: 2026-11-29

A migration is a frozen picture: it spells out its columns instead of importing the models.
Timestamps are timestamptz on PostgreSQL (naive UTC on SQLite, see models.UTCDateTime).
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def _timestamp(name: str, nullable: bool = True) -> sa.Column:
    return sa.Column(name, sa.DateTime(timezone=True), nullable=nullable)


def upgrade() -> None:
    op.create_table(
        "jobs",
        sa.Column("id", sa.String(64), primary_key=True),
        sa.Column("dialect", sa.String(16), nullable=False),
        sa.Column("endpoint", sa.String(64), nullable=False),
        sa.Column("model", sa.String(256), nullable=False),
        sa.Column("model_config", sa.JSON(), nullable=False),
        sa.Column("input", sa.JSON(), nullable=False),
        sa.Column("input_format", sa.String(32)),
        sa.Column("output_uri", sa.Text()),
        sa.Column("scale_output_uri", sa.Text()),
        sa.Column("output_file_id", sa.String(64)),
        sa.Column("error_file_id", sa.String(64)),
        sa.Column("metadata", sa.JSON(), nullable=False),
        sa.Column("labels", sa.JSON(), nullable=False),
        sa.Column("priority", sa.Integer(), nullable=False),
        sa.Column("data_parallelism", sa.Integer(), nullable=False),
        sa.Column("resources", sa.JSON(), nullable=False),
        sa.Column("max_runtime_sec", sa.Integer()),
        sa.Column("status", sa.String(32), nullable=False),
        sa.Column("status_reason", sa.Text()),
        _timestamp("created_at", nullable=False),
        _timestamp("updated_at", nullable=False),
        _timestamp("started_at"),
        _timestamp("in_progress_at"),
        _timestamp("finalizing_at"),
        _timestamp("completed_at"),
        _timestamp("failed_at"),
        _timestamp("cancelling_at"),
        _timestamp("cancelled_at"),
        _timestamp("expired_at"),
        _timestamp("expires_at"),
        _timestamp("cancel_requested_at"),
        sa.Column("total", sa.Integer(), nullable=False),
        sa.Column("completed", sa.Integer(), nullable=False),
        sa.Column("succeeded", sa.Integer(), nullable=False),
        sa.Column("failed", sa.Integer(), nullable=False),
        sa.Column("errors", sa.JSON(), nullable=False),
        sa.Column("owner", sa.String(256), nullable=False),
        sa.Column("dag_run_id", sa.String(256)),
    )
    op.create_index("ix_jobs_owner_created_at", "jobs", ["owner", "created_at"])
    op.create_index("ix_jobs_owner_status", "jobs", ["owner", "status"])
    op.create_index("ix_jobs_dialect_created_at", "jobs", ["dialect", "created_at"])
    op.create_index("ix_jobs_created_at", "jobs", ["created_at"])
    op.create_index("ix_jobs_model", "jobs", ["model"])

    op.create_table(
        "files",
        sa.Column("id", sa.String(64), primary_key=True),
        sa.Column("owner", sa.String(256), nullable=False),
        sa.Column("purpose", sa.String(32), nullable=False),
        sa.Column("filename", sa.String(512), nullable=False),
        sa.Column("bytes", sa.BigInteger(), nullable=False),
        sa.Column("uri", sa.Text(), nullable=False),
        sa.Column("kind", sa.String(16), nullable=False),
        sa.Column("job_id", sa.String(64)),
        _timestamp("created_at", nullable=False),
        _timestamp("expires_at"),
        _timestamp("deleted_at"),
    )
    op.create_index("ix_files_owner_created_at", "files", ["owner", "created_at"])
    op.create_index("ix_files_job_id", "files", ["job_id"])

    op.create_table(
        "api_keys",
        sa.Column("id", sa.String(64), primary_key=True),
        sa.Column("owner", sa.String(256), nullable=False),
        sa.Column("name", sa.String(256), nullable=False),
        sa.Column("prefix", sa.String(32), nullable=False),
        sa.Column("sha256", sa.String(64), nullable=False),
        sa.Column("is_admin", sa.Boolean(), nullable=False),
        _timestamp("created_at", nullable=False),
        _timestamp("revoked_at"),
    )
    op.create_index("ix_api_keys_owner", "api_keys", ["owner"])
    op.create_index("ix_api_keys_prefix", "api_keys", ["prefix"])


def downgrade() -> None:
    op.drop_table("api_keys")
    op.drop_table("files")
    op.drop_table("jobs")
