"""Connection arguments of Airflow's metadata DB on the embedded stack's SQLite: Airflow's
``[database] sql_alchemy_connect_args`` names ``CONNECT_ARGS`` (``llm_batch.devstack.stack``).

Airflow runs SQLite in WAL mode, where readers never wait but writers take turns. A scheduler
loop on a busy 2-core machine can hold the write lock longer than sqlite3's default busy
timeout of 5 s, and the writer waiting behind it then fails with "database is locked": a 500
from Airflow's REST API to whoever triggered a run or paused a DAG (seen in CI: a trigger
that took 5.1 s), or a failed state update in a task. A longer timeout makes that a wait.
"""

from __future__ import annotations

from typing import Any

# Seconds a writer waits for SQLite's lock before "database is locked" (sqlite3's default: 5).
BUSY_TIMEOUT_S = 60.0

CONNECT_ARGS: dict[str, Any] = {"timeout": BUSY_TIMEOUT_S}
