"""Webhook endpoints: when each last changed, and the previous secret of a rotation.

Revision ID: 0007
Revises: 0006
Create Date: 2027-01-20

``updated_at`` (existing rows: their creation time) is when the URL, events, description or
secret last changed. ``previous_secret`` signs deliveries beside the new secret until
``previous_secret_expires_at`` when a rotation keeps it for a grace period (OpenAI's
``rotate_secret(keep_old_secret_active_for_24_hours=True)``).
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("webhook_endpoints") as table:
        table.add_column(sa.Column("updated_at", sa.DateTime(timezone=True), nullable=True))
        table.add_column(sa.Column("previous_secret", sa.String(128), nullable=True))
        table.add_column(sa.Column("previous_secret_expires_at", sa.DateTime(timezone=True), nullable=True))
    op.execute("UPDATE webhook_endpoints SET updated_at = created_at")
    with op.batch_alter_table("webhook_endpoints") as table:
        table.alter_column("updated_at", existing_type=sa.DateTime(timezone=True), nullable=False)


def downgrade() -> None:
    with op.batch_alter_table("webhook_endpoints") as table:
        table.drop_column("previous_secret_expires_at")
        table.drop_column("previous_secret")
        table.drop_column("updated_at")
