"""Whether an Airflow user is an admin, as a task knows it (by ``dag_run.triggering_user_name``).

Only Airflow's simple auth manager keeps roles where a task can read them (its
``[core] simple_auth_manager_users``); other auth managers' users count as no admins here,
so their runs are held to their own files and folders.
"""

from __future__ import annotations

_SIMPLE = "SimpleAuthManager"


def is_admin(user_name: str) -> bool:
    from airflow.configuration import conf  # airflow

    if not conf.get("core", "auth_manager", fallback="").endswith(_SIMPLE):
        return False
    from airflow.api_fastapi.auth.managers.simple.simple_auth_manager import SimpleAuthManager  # airflow

    return any(u.username == user_name and (u.role or "").upper() == "ADMIN" for u in SimpleAuthManager.get_users())
