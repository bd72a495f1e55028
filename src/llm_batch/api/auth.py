"""Who is calling: an llm-batch API key (x-api-key, HTTP basic user, ``Bearer lbk_...``) or an
Airflow user (JWT or session cookie, checked by Airflow). Rules: docs/api.md "Auth and ownership".

401 means "who are you?" (with ``WWW-Authenticate``), 403 "known, not allowed". The session
cookie authenticates safe methods only: a page of another origin can make a browser send it (CSRF).
"""

from __future__ import annotations

import base64
import hmac
import re
from dataclasses import dataclass
from typing import Annotated, Any

from fastapi import Depends, HTTPException, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.security import APIKeyHeader, HTTPAuthorizationCredentials, HTTPBasic, HTTPBearer

from llm_batch.api.errors import ApiError
from llm_batch.api.state import DAG_ID, SettingsDep, StoreDep
from llm_batch.core import owners
from llm_batch.infra.jobstore import ApiKeyRepository
from llm_batch.infra.jobstore.api_keys import API_KEY_PREFIX

# Declared for the OpenAPI document; get_caller decides.
_bearer = HTTPBearer(auto_error=False, description="An llm-batch API key (lbk_...) or an Airflow JWT")
_api_key_header = APIKeyHeader(name="x-api-key", auto_error=False, description="An llm-batch API key")


class _DocumentedBasic(HTTPBasic):
    """HTTP basic for the document only: FastAPI's parsing would answer a vague 401 (auto_error off too)."""

    async def __call__(self, request: Request) -> None:  # type: ignore[override]
        return None


_basic = _DocumentedBasic(auto_error=False, description="An llm-batch API key as the user name")

_UNAUTHENTICATED = {"WWW-Authenticate": "Bearer"}
_INVALID = {"WWW-Authenticate": 'Bearer error="invalid_token"'}

# What an API key can look like: anything else never reaches the store (NUL breaks some drivers).
_KEY_SHAPE = re.compile(r"[A-Za-z0-9_-]{1,256}")
_SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})  # the session cookie's


def unauthenticated(message: str, *, invalid: bool = True, code: str = "invalid_credentials") -> ApiError:
    """The one form of every 401; `invalid`: credentials given but unusable (RFC 6750)."""
    return ApiError(401, message, code=code, headers=_INVALID if invalid else _UNAUTHENTICATED)


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


def _authorization(request: Request) -> tuple[str, str] | None:
    """(scheme in lower case, value) of the Authorization header."""
    header = request.headers.get("authorization")
    if header is None:
        return None
    scheme, _, value = header.strip().partition(" ")
    return scheme.lower(), value.strip()


def _basic_user(value: str) -> str:
    """The user name of ``Authorization: Basic`` credentials: our API key."""
    try:
        # ValueError covers binascii.Error, UnicodeDecodeError and non-ASCII text.
        user, _, _ = base64.b64decode(value, validate=True).decode().partition(":")
    except ValueError:
        raise unauthenticated("malformed HTTP basic credentials: not base64 of UTF-8 'user:password'") from None
    if not user:
        raise unauthenticated("HTTP basic credentials carry no user name: give an llm-batch API key as the user name")
    return user


def api_key_of(request: Request) -> str | None:
    """The API key the request carries, in any of the three accepted forms."""
    if (key := request.headers.get("x-api-key")) is not None:
        if not key.strip():
            raise unauthenticated("the x-api-key header is empty: give an llm-batch API key", code="invalid_api_key")
        return key.strip()
    authorization = _authorization(request)
    if authorization is None:
        return None
    scheme, value = authorization
    if scheme == "basic":
        return _basic_user(value)
    if scheme == "bearer" and value.startswith(API_KEY_PREFIX):
        return value
    return None


def _key_caller(store: ApiKeyRepository, plaintext: str) -> Caller:
    key = store.identify_api_key(plaintext) if _KEY_SHAPE.fullmatch(plaintext) else None
    if key is None:
        raise unauthenticated("invalid or revoked API key", code="invalid_api_key")
    return Caller(name=key.owner, is_admin=key.is_admin, can_submit=True, via="api_key")


async def _airflow_user(request: Request, bearer: HTTPAuthorizationCredentials | None) -> Any:
    """Airflow's own check of its JWT; its 401 and 403 are both 401 here (the caller is unknown)."""
    from airflow.api_fastapi.core_api.security import get_user  # airflow

    try:
        return await get_user(request, None, bearer)
    except HTTPException as exc:
        if exc.status_code not in (401, 403):
            raise
        raise _token_refusal(request, bearer, str(exc.detail)) from None


def _token_refusal(request: Request, bearer: HTTPAuthorizationCredentials | None, detail: str) -> ApiError:
    """The 401 saying why Airflow found no user in this request."""
    from airflow.api_fastapi.auth.managers.base_auth_manager import COOKIE_NAME_JWT_TOKEN  # airflow

    if bearer is not None:
        return unauthenticated(f"Airflow token refused: {detail}", code="invalid_token")
    if request.cookies.get(COOKIE_NAME_JWT_TOKEN):
        return unauthenticated(f"Airflow session cookie refused: {detail}", code="invalid_token")
    authorization = _authorization(request)
    if authorization is None:
        message = "no credentials: send an llm-batch API key (Authorization: Bearer, x-api-key or HTTP basic) or an Airflow JWT"
        return unauthenticated(message, invalid=False, code="not_authenticated")
    scheme, _ = authorization
    if not scheme:
        return unauthenticated("the Authorization header is empty")
    if scheme == "bearer":
        return unauthenticated("empty Bearer token: give an llm-batch API key or an Airflow JWT")
    shown = request.headers["authorization"].strip().partition(" ")[0][:20]
    return unauthenticated(f"unsupported Authorization scheme {shown!r}: use Bearer (an llm-batch API key or an "
                           "Airflow JWT), Basic with an API key as the user name, or x-api-key", invalid=False)


def is_airflow_admin(user: Any) -> bool:
    """Admin role of Airflow's simple auth manager (``role``) or FAB (``roles``)."""
    role = getattr(user, "role", None)
    if isinstance(role, str) and role.upper() == "ADMIN":
        return True
    roles = getattr(user, "roles", None) or []
    return any(getattr(r, "name", r) == "Admin" for r in roles)


def _airflow_caller(request: Request, user: Any) -> Caller:
    from airflow.api_fastapi.auth.managers.models.resource_details import DagAccessEntity, DagDetails  # airflow

    manager = auth_manager(request.app)
    details = DagDetails(id=DAG_ID)

    def allowed(method: str) -> bool:
        return manager.is_authorized_dag(method=method, access_entity=DagAccessEntity.RUN, details=details, user=user)

    if not allowed("GET"):
        raise ApiError(403, f"user {user.get_name()!r} may not read runs of DAG {DAG_ID!r}", code="forbidden")
    return Caller(name=user.get_name(), is_admin=is_airflow_admin(user), can_submit=allowed("POST"), via="airflow")


def auth_manager(app: Any) -> Any:
    """The app's auth manager (tests set one), else Airflow's."""
    manager = getattr(getattr(app, "state", None), "auth_manager", None)
    if manager is None:
        from airflow.api_fastapi.app import get_auth_manager  # airflow

        manager = get_auth_manager()
    return manager


async def get_caller(
    request: Request,
    store: StoreDep,
    bearer: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)] = None,
    _x_api_key: Annotated[str | None, Depends(_api_key_header)] = None,
    _basic_credentials: Annotated[Any, Depends(_basic)] = None,
) -> Caller:
    """The caller; 403 for a write only the cookie authenticates, or a name that is no owner name."""
    if (key := api_key_of(request)) is not None:
        caller = await run_in_threadpool(_key_caller, store, key)
    else:
        user = await _airflow_user(request, bearer)
        if bearer is None and request.method not in _SAFE_METHODS:  # known by the cookie alone
            raise ApiError(403, f"{request.method} changes state: send your credentials in the Authorization or "
                           "x-api-key header, not only the session cookie", code="csrf_refused")
        caller = await run_in_threadpool(_airflow_caller, request, user)
    if not owners.is_canonical(caller.name):
        raise ApiError(403, f"{caller.name!r} cannot own jobs or files here: owner names are {owners.RULE} "
                       "(ask an admin for a key of a canonical name)", code="invalid_owner_name")
    return caller


CallerDep = Annotated[Caller, Depends(get_caller)]


async def metrics_reader(
    request: Request,
    store: StoreDep,
    settings: SettingsDep,
    bearer: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)] = None,
) -> None:
    """The metrics token (``Authorization: Bearer``) or an admin may read ``/metrics``."""
    token = settings.metrics_token.get_secret_value() if settings.metrics_token else ""
    authorization = _authorization(request)
    if token and authorization and authorization[0] == "bearer" and hmac.compare_digest(
            authorization[1].encode(), token.encode()):
        return
    caller = await get_caller(request, store, bearer)
    if not caller.is_admin:
        raise ApiError(403, "metrics are for admins and for the metrics token (LLM_BATCH_METRICS_TOKEN)",
                       code="forbidden")
