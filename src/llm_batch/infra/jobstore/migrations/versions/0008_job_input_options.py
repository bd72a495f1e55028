"""The job's input records the options its dialect implied (data only, no schema change).

Revision ID: 0008
Revises: 0007
Create Date: 2027-01-27

The pipeline no longer reads the job's dialect: the API edge sets what differs in the job's
input (``llm_batch.core.job_spec.JobInput``). Rows made before say it here, as their dialect
meant it: a Scale job's results are also a JSON array (``output_format``), an OpenAI job's
moderation results carry ``flagged`` (``moderation_shape``). Other keys are kept as they are.
Downgrade drops the two keys (the old code derives them from the dialect again).
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None

# Frozen here (a migration is a picture of its time): the dialect -> what it implied.
_IMPLIED = {"scale": ("output_format", "json_array"), "openai": ("moderation_shape", "flagged")}

_jobs = sa.table("jobs", sa.column("id", sa.String), sa.column("dialect", sa.String), sa.column("input", sa.JSON))


def _rewrite(change) -> None:
    connection = op.get_bind()
    rows = connection.execute(sa.select(_jobs.c.id, _jobs.c.dialect, _jobs.c.input)
                              .where(_jobs.c.dialect.in_(list(_IMPLIED)))).all()
    for job_id, dialect, given in rows:
        stored = dict(given or {})
        new = change(stored, *_IMPLIED[dialect])
        if new != stored:
            connection.execute(sa.update(_jobs).where(_jobs.c.id == job_id).values(input=new))


def upgrade() -> None:
    _rewrite(lambda stored, key, value: {**stored, key: stored.get(key, value)})


def downgrade() -> None:
    _rewrite(lambda stored, key, value: {k: v for k, v in stored.items() if k != key})
