"""The job's extra results copy is named for what it is (a JSON array), not for a dialect.

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-01

``scale_output_uri`` held the path where merge also writes the results as one JSON array
in input order: Scale's output_data_path, and the DAG form's output_uri. Same column, a
neutral name.
"""

from __future__ import annotations

from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.alter_column("scale_output_uri", new_column_name="array_output_uri")


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.alter_column("array_output_uri", new_column_name="scale_output_uri")
