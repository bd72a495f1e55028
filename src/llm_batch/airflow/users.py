"""Whether an Airflow user is an admin, as a task of a DAG run can tell (it has the user's
name, ``dag_run.triggering_user_name``, not a request or a token).

Airflow's simple auth manager (the default, and the embedded stack's) keeps its users and
their roles in Airflow's configuration (``[core] simple_auth_manager_users``, ``name:role``),
read here as it reads them. Other auth managers (FAB, Keycloak, ...) keep roles where a task
cannot see them: their users count as no admins here, so their runs are held to their own
files and folders (an admin acts for anyone through the API).
"""

from __future__ import annotations

_SIMPLE = "SimpleAuthManager"


def is_admin(user_name: str) -> bool:
    from airflow.configuration import conf  # airflow

    if not conf.get("core", "auth_manager", fallback="").endswith(_SIMPLE):
        return False
    from airflow.api_fastapi.auth.managers.simple.simple_auth_manager import SimpleAuthManager  # airflow

    return any(u.username == user_name and (u.role or "").upper() == "ADMIN" for u in SimpleAuthManager.get_users())
