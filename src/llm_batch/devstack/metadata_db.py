"""Airflow's ``[database] sql_alchemy_connect_args`` on the embedded stack's SQLite (stack.py).

A scheduler loop on a busy machine can hold SQLite's write lock past sqlite3's default busy
timeout of 5 s; the writer behind it then failed with "database is locked" (a 500 from the
REST API, a failed task state update). A longer timeout makes that a wait.
"""

from __future__ import annotations

from typing import Any

BUSY_TIMEOUT_S = 60.0

CONNECT_ARGS: dict[str, Any] = {"timeout": BUSY_TIMEOUT_S}
