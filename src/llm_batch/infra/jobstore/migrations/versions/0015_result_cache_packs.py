"""The result cache's answers in packs: where in its pack each answer starts.

Revision ID: 0015
Revises: 0014
Create Date: 2027-04-20

``result_cache.at_byte``: the byte where the answer starts in the pack object ``uri`` (one
object per shard of the job that computed it); None for an entry made before packs, whose
object holds it alone. An index on ``uri``: a pack is deleted once no entry names it.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0015"
down_revision = "0014"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("result_cache") as batch:
        batch.add_column(sa.Column("at_byte", sa.BigInteger(), nullable=True))
    op.create_index("ix_result_cache_uri", "result_cache", ["uri"])


def downgrade() -> None:
    op.drop_index("ix_result_cache_uri", "result_cache")
    with op.batch_alter_table("result_cache") as batch:
        batch.drop_column("at_byte")
