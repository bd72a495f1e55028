"""A job's usage per model that answered (its base, its LoRA adapters).

Revision ID: 0010
Revises: 0009
Create Date: 2027-03-01

One nullable JSON column on ``jobs``: ``model_usage``, ``{model: {"succeeded", "prompt_tokens",
"completion_tokens"}}`` summed by the merge over the output lines by the model each names.
Jobs merged before this revision keep null (their usage counts under their own model).
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("model_usage", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("model_usage")
