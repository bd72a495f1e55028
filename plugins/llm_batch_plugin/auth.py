"""Who is calling: an Airflow user (JWT checked by Airflow's security code) or an API key.

Accepted credentials, first match wins:
- ``x-api-key: <key>`` (Scale's client sends this),
- ``Authorization: Basic`` with the key as user name (Scale's client, requests' auth tuple),
- ``Authorization: Bearer <key>`` where the key starts with ``lbk_`` (OpenAI, Mistral SDKs),
- ``Authorization: Bearer <Airflow JWT>`` or Airflow's session cookie (``/auth/token``).

An API key acts for its owner, may submit, and is admin if created so. An Airflow user's
rights come from Airflow's auth manager on the ``batch_inference`` DAG's runs (a viewer may
read, not submit); Airflow admins see every job. Non-admins see only their own objects.
"""

from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass
from typing import Annotated, Any

from fastapi import Depends, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.security import APIKeyHeader, HTTPAuthorizationCredentials, HTTPBasic, HTTPBearer

from llm_batch.jobstore import JobStore
from llm_batch.jobstore.store import API_KEY_PREFIX
from llm_batch_plugin.errors import ApiError
from llm_batch_plugin.state import DAG_ID, StoreDep

# Declared so /batch/openapi.json and /batch/docs show the three ways to authenticate;
# none raises by itself: get_caller decides.
_bearer = HTTPBearer(auto_error=False, description="An llm-batch API key (lbk_...) or an Airflow JWT")
_api_key_header = APIKeyHeader(name="x-api-key", auto_error=False, description="An llm-batch API key")


class _DocumentedBasic(HTTPBasic):
    """HTTP basic for the OpenAPI document only: FastAPI's own parsing answers a vague 401
    (even with auto_error off) to credentials ``_basic_user`` explains precisely."""

    async def __call__(self, request: Request) -> None:  # type: ignore[override]
        return None


_basic = _DocumentedBasic(auto_error=False, description="An llm-batch API key as the user name")

_UNAUTHENTICATED = {"WWW-Authenticate": "Bearer"}


@dataclass(frozen=True)
class Caller:
    """The authenticated principal of one request."""

    name: str  # recorded as the owner of what it creates
    is_admin: bool
    can_submit: bool
    via: str  # "api_key" or "airflow"

    @property
    def owner_filter(self) -> str | None:
        """The owner to restrict store calls to: None (everything) for admins."""
        return None if self.is_admin else self.name

    def require_submit(self) -> None:
        if not self.can_submit:
            raise ApiError(403, f"user {self.name!r} may read batch jobs but not submit or change them", code="forbidden")


def _basic_user(request: Request) -> str | None:
    """The user name of ``Authorization: Basic`` credentials (our API key), else None;
    401 saying what is wrong when the header is Basic but carries no key."""
    scheme, _, value = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "basic":
        return None
    try:
        user, _, _ = base64.b64decode(value.strip(), validate=True).decode().partition(":")
    except (binascii.Error, UnicodeDecodeError):
        raise ApiError(401, "malformed HTTP basic credentials: not base64 of UTF-8 'user:password'", headers=_UNAUTHENTICATED) from None
    if not user:
        raise ApiError(401, "HTTP basic credentials carry no user name: give an llm-batch API key as the user name", headers=_UNAUTHENTICATED)
    return user


def api_key_of(request: Request) -> str | None:
    """The API key the request carries, in any of the three accepted forms, else None."""
    if key := request.headers.get("x-api-key"):
        return key.strip()
    if key := _basic_user(request):
        return key
    scheme, _, value = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() == "bearer" and value.strip().startswith(API_KEY_PREFIX):
        return value.strip()
    return None


def _key_caller(store: JobStore, plaintext: str) -> Caller:
    key = store.identify_api_key(plaintext)
    if key is None:
        raise ApiError(401, "invalid or revoked API key", code="invalid_api_key", headers=_UNAUTHENTICATED)
    return Caller(name=key.owner, is_admin=key.is_admin, can_submit=True, via="api_key")


def _is_airflow_admin(user: Any) -> bool:
    """Admin role of Airflow's simple auth manager (``role``) or FAB (``roles``)."""
    role = getattr(user, "role", None)
    if isinstance(role, str) and role.upper() == "ADMIN":
        return True
    roles = getattr(user, "roles", None) or []
    return any(getattr(r, "name", r) == "Admin" for r in roles)


def _airflow_caller(request: Request, user: Any) -> Caller:
    from airflow.api_fastapi.auth.managers.models.resource_details import DagAccessEntity, DagDetails

    auth_manager = _auth_manager(request)
    details = DagDetails(id=DAG_ID)

    def allowed(method: str) -> bool:
        return auth_manager.is_authorized_dag(
            method=method, access_entity=DagAccessEntity.RUN, details=details, user=user
        )

    if not allowed("GET"):
        raise ApiError(403, f"user {user.get_name()!r} may not read runs of DAG {DAG_ID!r}", code="forbidden")
    return Caller(name=user.get_name(), is_admin=_is_airflow_admin(user), can_submit=allowed("POST"), via="airflow")


def _auth_manager(request: Request):
    manager = getattr(request.app.state, "auth_manager", None)
    if manager is None:
        from airflow.api_fastapi.app import get_auth_manager

        manager = get_auth_manager()
    return manager


async def get_caller(
    request: Request,
    store: StoreDep,
    bearer: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)] = None,
    _x_api_key: Annotated[str | None, Depends(_api_key_header)] = None,
    _basic_credentials: Annotated[Any, Depends(_basic)] = None,
) -> Caller:
    """The caller of this request; 401 without (valid) credentials."""
    if (key := api_key_of(request)) is not None:
        return await run_in_threadpool(_key_caller, store, key)
    # Airflow's own check of its JWT (header or cookie); raises 401/403 itself.
    from airflow.api_fastapi.core_api.security import get_user

    user = await get_user(request, None, bearer)
    return await run_in_threadpool(_airflow_caller, request, user)


CallerDep = Annotated[Caller, Depends(get_caller)]
