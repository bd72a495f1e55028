"""Alembic environment of the job store.

Run through ``llm_batch.infra.jobstore.database.upgrade_to_head``, which passes an open connection
(holding the migration lock) in ``config.attributes["connection"]``. Run by hand, the URL
comes from ``-x url=...``.
"""

from __future__ import annotations

from alembic import context
from sqlalchemy import create_engine

from llm_batch.infra.jobstore.database import VERSION_TABLE
from llm_batch.infra.jobstore.models import Base


def _run(connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=Base.metadata,
        version_table=VERSION_TABLE,
        render_as_batch=connection.dialect.name == "sqlite",  # SQLite ALTERs need batch mode
        compare_type=True,
    )
    with context.begin_transaction():
        context.run_migrations()


def main() -> None:
    connection = context.config.attributes.get("connection")
    if connection is not None:
        _run(connection)
        return
    url = context.get_x_argument(as_dictionary=True).get("url")
    if not url:
        raise SystemExit("give the database URL: alembic -x url=<sqlalchemy url> ...")
    with create_engine(url).begin() as conn:
        _run(conn)


if context.is_offline_mode():
    raise SystemExit("offline (--sql) migrations are not supported by the job store")
main()
