"""Whether an Airflow user is an admin, as a task knows it (by ``dag_run.triggering_user_name``):
only the simple auth manager keeps roles a task can read, so other managers' users are no admins."""

from __future__ import annotations

_SIMPLE = "SimpleAuthManager"


def is_admin(user_name: str) -> bool:
    from airflow.configuration import conf  # airflow

    if not conf.get("core", "auth_manager", fallback="").endswith(_SIMPLE):
        return False
    from airflow.api_fastapi.auth.managers.simple.simple_auth_manager import SimpleAuthManager  # airflow

    return any(u.username == user_name and (u.role or "").upper() == "ADMIN" for u in SimpleAuthManager.get_users())
