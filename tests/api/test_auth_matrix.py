"""Authorization matrix: every operation of ``/batch/openapi.json`` (read from the document
itself, so a new route is covered without a change here) x every kind of caller, with the
status class each cell must answer; never a 5xx; every status seen is declared in the
document. Path ids are real objects of alice's (a missing id for a parameter not known
here). Creates reach the store but start no DAG run (the trigger is replaced): no engine,
no scheduler, about 15 s in all.
"""

from __future__ import annotations

import asyncio
import base64
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest

from llm_batch.api.errors import OPENAI_PREFIXES
from tests.api.conftest import chat_lines

pytestmark = pytest.mark.airflow

MISSING_ID = "missing-0000"
READS = {"get", "head"}
# Operations for admins only: every other valid caller gets 403 (in the dialect's error shape).
# None today: /v1/usage answers a non-admin their own usage.
ADMIN_ONLY: set[tuple[str, str]] = set()
MODEL = "tiny-random-llama"


def _basic(raw: bytes) -> str:
    return "Basic " + base64.b64encode(raw).decode()


@dataclass(frozen=True)
class Kind:
    """One kind of caller: how its headers are made, and what it is."""

    name: str
    headers: Callable[[Any], dict[str, Any]]  # (the module's Secrets) -> headers
    role: str  # none | malformed | bad | other | viewer | owner | admin
    token_refused: bool = False  # 401 must say error="invalid_token"
    cookie_only: bool = False  # known by the session cookie alone: reads only (writes: 403 csrf_refused)


# Malformed: a header that names no usable credentials, whatever bytes it holds.
MALFORMED = {
    "basic-not-base64": ({"Authorization": "Basic !!!"}, True),
    "basic-not-ascii": ({"Authorization": "Basic \xff\xe9".encode("latin-1")}, True),
    "basic-not-utf8": ({"Authorization": _basic(b"\xff\xfe:pw")}, True),
    "basic-no-colon": ({"Authorization": _basic(b"lbk_not-a-key")}, True),
    "basic-empty-user": ({"Authorization": _basic(b":password")}, True),
    "basic-empty": ({"Authorization": "Basic "}, True),
    "bearer-empty": ({"Authorization": "Bearer "}, True),
    "bearer-junk": ({"Authorization": "Bearer junk"}, True),
    "bearer-malformed-jwt": ({"Authorization": "Bearer eyJhbGciOiJIUzUxMiJ9.e30.x"}, True),
    "bearer-control-bytes": ({"Authorization": b"Bearer \x00\x01\x7f\x1b"}, True),
    "bearer-not-latin1": ({"Authorization": "Bearer ключ".encode()}, True),
    "scheme-digest": ({"Authorization": "Digest x"}, False),
    "scheme-missing": ({"Authorization": "x"}, False),
    "authorization-empty": ({"Authorization": ""}, True),
    "x-api-key-empty": ({"x-api-key": ""}, True),
    "x-api-key-junk": ({"x-api-key": b"junk\x00\xff\r"}, True),
    "cookie-junk": ({"Cookie": "_token=junk"}, True),
}

KINDS = [
    Kind("no-credentials", lambda s: {}, "none"),
    *(Kind(name, lambda s, h=headers: h, "malformed", refused) for name, (headers, refused) in MALFORMED.items()),
    Kind("jwt-expired", lambda s: {"Authorization": f"Bearer {s.expired_jwt}"}, "malformed", True),
    Kind("jwt-other-signing-key", lambda s: {"Authorization": f"Bearer {s.foreign_jwt}"}, "malformed", True),
    Kind("key-unknown", lambda s: {"Authorization": "Bearer lbk_" + "A" * 43}, "bad", True),
    Kind("key-unknown-x-api-key", lambda s: {"x-api-key": "lbk_" + "B" * 43}, "bad", True),
    Kind("key-revoked", lambda s: {"Authorization": f"Bearer {s.revoked_key}"}, "bad", True),
    Kind("other-owner-key", lambda s: s.creds.key("bob"), "other"),
    Kind("other-owner-jwt", lambda s: s.creds.jwt("bob"), "other"),
    Kind("viewer-jwt", lambda s: s.creds.jwt("vic"), "viewer"),
    Kind("owner-key", lambda s: s.creds.key("alice"), "owner"),
    Kind("owner-key-basic", lambda s: {"Authorization": _basic(s.creds.keys["alice"].encode() + b":")}, "owner"),
    Kind("owner-jwt", lambda s: s.creds.jwt("alice"), "owner"),
    Kind("owner-session-cookie", lambda s: {"Cookie": f"_token={s.creds.tokens['alice']}"}, "owner", cookie_only=True),
    # Airflow's rule: a header in another scheme (a proxy's) leaves the session cookie in charge.
    Kind("owner-cookie-and-digest", lambda s: {"Cookie": f"_token={s.creds.tokens['alice']}", "Authorization": "Digest x"},
         "owner", cookie_only=True),
    Kind("admin-key", lambda s: s.creds.key("admin-key"), "admin"),
    Kind("admin-jwt", lambda s: s.creds.jwt("root"), "admin"),
]


@dataclass(frozen=True)
class Operation:
    method: str  # lower case, as in the document
    path: str  # template, e.g. /v1/files/{file_id}
    spec: dict[str, Any]

    @property
    def path_params(self) -> list[str]:
        return re.findall(r"{(\w+)}", self.path)

    @property
    def secured(self) -> bool:
        return bool(self.spec.get("security"))

    @property
    def writes(self) -> bool:
        return self.method not in READS

    @property
    def admin_only(self) -> bool:
        return (self.method, self.path) in ADMIN_ONLY

    @property
    def openai(self) -> bool:
        return self.path.startswith(OPENAI_PREFIXES)

    def __str__(self) -> str:
        return f"{self.method.upper()} {self.path}"


@dataclass
class Secrets:
    creds: Any
    revoked_key: str
    expired_jwt: str
    foreign_jwt: str


# -- fixtures --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def api(batch_app):
    from fastapi.testclient import TestClient

    with TestClient(batch_app, base_url="http://testserver/batch", raise_server_exceptions=False) as client:
        yield client


@pytest.fixture(scope="module")
def document(api) -> dict[str, Any]:
    response = api.get("/openapi.json")
    assert response.status_code == 200
    return response.json()


@pytest.fixture(scope="module")
def operations(document) -> list[Operation]:
    found = [
        Operation(method, path, spec)
        for path, item in document["paths"].items()
        for method, spec in item.items()
        if method in {"get", "post", "put", "patch", "delete", "head"}
    ]
    assert len(found) >= 14, [str(o) for o in found]
    return found


@pytest.fixture(scope="module")
def no_dag_runs(batch_api):
    """Creates reach the store; the trigger records nothing in Airflow (no run, no engine)."""
    from llm_batch.api.dag_trigger import get_trigger, run_id_for

    batch_api.dependency_overrides[get_trigger] = lambda: (lambda job_id, conf, submitted_at: run_id_for(job_id))
    yield
    batch_api.dependency_overrides.pop(get_trigger, None)


def _scale_body() -> dict[str, Any]:
    return {"content": [{"prompt": "hi", "max_tokens": 2}], "output_data_path": f"matrix/{uuid.uuid4().hex}.json",
            "model_config": {"model": MODEL}}


# The body of each operation that takes one: valid, so a refusal is the caller's, not the body's.
BODIES: dict[tuple[str, str], Callable[[dict[str, str]], dict[str, Any]]] = {
    ("post", "/v1/files"): lambda ids: {"files": {"file": ("m.jsonl", chat_lines(1))}, "data": {"purpose": "batch"}},
    # The schema's fields (the archive itself is refused after the caller's rights: 400).
    ("post", "/v1/adapters"): lambda ids: {"files": {"file": ("a.tar.gz", b"not an archive")},
                                           "data": {"name": "matrix-bot", "base": MODEL}},
    ("post", "/v1/batches"): lambda ids: {"json": {"input_file_id": ids["file"], "endpoint": "/v1/chat/completions",
                                                   "completion_window": "24h"}},
    ("post", "/v1/batch/jobs"): lambda ids: {"json": {
        "requests": [{"custom_id": "0", "body": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}}],
        "endpoint": "/v1/chat/completions", "model": MODEL}},
    ("post", "/v1/jobs"): lambda ids: {"json": {
        "requests": [{"custom_id": "0", "body": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}}],
        "model": MODEL}},
    ("post", "/v2/batch-completions"): lambda ids: {"json": _scale_body()},
    ("post", "/v1/llm/batch-completions"): lambda ids: {"json": _scale_body()},
    ("post", "/v2/batch-completions/{batch_completion_id}"): lambda ids: {"json": {"priority": "high"}},
    # Webhooks: a public name (not resolved at create when DNS has no answer; checked again at delivery).
    ("post", "/v1/webhooks"): lambda ids: {"json": {"url": "https://hooks.example.com/llm-batch"}},
    ("post", "/v1/webhooks/{endpoint_id}/test"): lambda ids: {"json": {"event_type": "batch.completed"}},
    ("post", "/v1/webhook_endpoints"): lambda ids: {"json": {
        "url": "https://hooks.example.com/llm-batch", "name": "matrix", "event_types": ["batch.completed"]}},
    ("post", "/v1/webhook_endpoints/{webhook_endpoint_id}"): lambda ids: {"json": {"name": "renamed"}},
    ("post", "/v1/webhook_endpoints/{webhook_endpoint_id}/rotate_secret"): lambda ids: {
        "json": {"keep_old_secret_active_for_24_hours": True}},
    ("post", "/v1/webhook_endpoints/{webhook_endpoint_id}/test"): lambda ids: {"json": {"event_type": "batch.completed"}},
}


def _body(method: str, path: str, ids: dict[str, str]) -> dict[str, Any]:
    """The request arguments of the operation's valid body (none if it takes none)."""
    make = BODIES.get((method, path))
    return make(ids) if make else {}


def _made(api, creds, path: str, ids: dict[str, str], key: str = "id") -> str:
    """The id of a new object of alice's, made by POST `path`."""
    response = api.post(path, headers=creds.key("alice"), **_body("post", path, ids))
    assert response.status_code == 200, response.text
    return response.json()[key]


@pytest.fixture(scope="module")
def objects(api, creds, no_dag_runs) -> dict[str, str]:
    """Alice's file and one job per dialect, made through the API."""
    ids = {"file": _made(api, creds, "/v1/files", {})}
    ids["openai"] = _made(api, creds, "/v1/batches", ids)
    ids["mistral"] = _made(api, creds, "/v1/batch/jobs", ids)
    ids["scale"] = _made(api, creds, "/v2/batch-completions", ids, "job_id")
    return ids


@pytest.fixture(scope="module")
def secrets(creds, api_store, auth_manager) -> Secrets:
    import jwt
    from airflow.api_fastapi.auth.managers.simple.user import SimpleAuthManagerUser

    record, revoked = api_store.create_api_key("alice", "matrix: revoked")
    api_store.revoke_api_key(record.id)
    expired = auth_manager.generate_jwt(SimpleAuthManagerUser(username="alice", role="user"), expiration_time_in_seconds=-3600)
    claims = jwt.decode(creds.tokens["alice"], options={"verify_signature": False})
    foreign = jwt.encode(claims, "another-signing-key-" + "y" * 64, algorithm=jwt.get_unverified_header(creds.tokens["alice"])["alg"])
    return Secrets(creds=creds, revoked_key=revoked, expired_jwt=expired, foreign_jwt=foreign)


# Which object a path parameter names (by name); any other parameter gets MISSING_ID.
PARAM_OBJECTS = {"file_id": "file", "batch_id": "openai", "job_id": "mistral", "batch_completion_id": "scale"}
MADE_BY = {"file": "/v1/files", "mistral": "/v1/batch/jobs"}  # the kinds a route deletes


def _call(api, operation: Operation, headers: dict[str, Any], objects: dict[str, str], creds) -> tuple[Any, bool, list[str]]:
    """The response of one cell, whether its path names a real object of alice's, and the
    ids put in the path. A delete gets an object of its own (the cell may delete it: a file,
    or a job, which a cancel earlier in the matrix may have ended)."""
    values, real = {}, bool(operation.path_params)
    for name in operation.path_params:
        kind = PARAM_OBJECTS.get(name)
        real = real and kind is not None
        if kind in MADE_BY and operation.method == "delete":
            values[name] = _made(api, creds, MADE_BY[kind], objects)
        else:
            values[name] = objects[kind] if kind else MISSING_ID
    path = operation.path.format(**values)
    response = api.request(operation.method.upper(), path, headers=headers, **_body(operation.method, operation.path, objects))
    return response, real, list(values.values())


def _shape_problem(operation: Operation, status: int, body: Any) -> str | None:
    """None if `body` is the error body the document declares for the operation's dialect."""
    if operation.openai:
        error = body.get("error") if isinstance(body, dict) else None
        ok = isinstance(error, dict) and set(error) == {"message", "type", "param", "code"} and isinstance(error["message"], str)
    elif status == 422:
        ok = isinstance(body, dict) and isinstance(body.get("detail"), list) and isinstance(body.get("message"), str)
    else:
        ok = isinstance(body, dict) and isinstance(body.get("detail"), str) and {"param", "code"} <= set(body)
    return None if ok else f"{status} is not the {'OpenAI' if operation.openai else 'detail'} error shape: {body}"


def _problem(kind: Kind, operation: Operation, response, real_id: bool) -> str | None:
    """What is wrong with one cell's answer, or None."""
    status, text = response.status_code, response.text[:200]
    if status >= 500:
        return f"server error {status}: {text}"
    if not operation.secured:  # open routes ignore credentials of any kind
        return f"open route answered {status}" if status in (401, 403) else None
    if status >= 400 and (shape := _shape_problem(operation, status, response.json())):
        return shape
    if kind.role in ("none", "malformed", "bad"):
        return _refusal_problem(kind, operation, response)
    if kind.cookie_only and operation.writes:
        code = _code(operation, response.json()) if status == 403 else None
        return None if code == "csrf_refused" else f"a write on the cookie alone: wanted 403 csrf_refused, got {status}: {text}"
    if operation.admin_only and kind.role != "admin":
        return None if status == 403 else f"admin-only route: wanted 403, got {status}: {text}"
    if status in (401, 403) and not (kind.role == "viewer" and operation.writes and status == 403):
        return f"valid credentials answered {status}: {text}"
    if kind.role == "viewer" and operation.writes and status != 403:
        return f"viewer write: wanted 403, got {status}: {text}"
    if kind.role in ("other", "viewer") and real_id and status not in (403, 404):
        return f"someone else's object: wanted 404, got {status}: {text}"
    if kind.role in ("owner", "admin") and real_id and status == 404:
        return f"the owner's object answered 404: {text}"
    return None


def _refusal_problem(kind: Kind, operation: Operation, response) -> str | None:
    """A caller without usable credentials: 401 with the right challenge (and code)."""
    if response.status_code != 401:
        return f"wanted 401, got {response.status_code}: {response.text[:200]}"
    challenge = response.headers.get("www-authenticate", "")
    if not challenge.startswith("Bearer"):
        return f"401 without a Bearer WWW-Authenticate challenge: {challenge!r}"
    if kind.token_refused != ('error="invalid_token"' in challenge):
        return f"WWW-Authenticate {challenge!r} (invalid_token wanted: {kind.token_refused})"
    if kind.role == "bad" and _code(operation, response.json()) != "invalid_api_key":
        return f"wanted code invalid_api_key: {response.text[:200]}"
    return None


def _code(operation: Operation, body: dict[str, Any]) -> str | None:
    return body["error"]["code"] if operation.openai else body.get("code")


# -- the matrix -------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS, ids=[k.name for k in KINDS])
def test_matrix(kind, api, operations, objects, secrets, creds):
    """One row: this kind of caller on every operation; each answer is what the cell wants
    and is declared in the document."""
    problems = []
    for operation in operations:
        response, real_id, _ = _call(api, operation, kind.headers(secrets), objects, creds)
        if problem := _problem(kind, operation, response, real_id):
            problems.append(f"{operation} -> {problem}")
        if str(response.status_code) not in operation.spec["responses"]:
            problems.append(f"{operation} -> {response.status_code} is not declared in the OpenAPI document")
    assert not problems, "\n".join(problems)


def test_matrix_covers_every_operation_with_a_body(operations):
    """A new route that takes a body needs an example body here (a refusal of an invalid
    body would hide whether the caller was allowed)."""
    missing = [str(o) for o in operations if "requestBody" in o.spec and (o.method, o.path) not in BODIES]
    assert not missing, f"add a valid body to BODIES for: {missing}"


def test_someone_elses_id_answers_like_a_missing_id(api, operations, objects, creds):
    """No existence oracle: bob on alice's object gets the very answer of a missing id."""
    compared = 0
    for operation in operations:
        if not operation.secured or not operation.path_params:
            continue
        response, real_id, ids = _call(api, operation, creds.key("bob"), objects, creds)
        missing = api.request(
            operation.method.upper(), operation.path.format(**dict.fromkeys(operation.path_params, MISSING_ID)),
            headers=creds.key("bob"), **_body(operation.method, operation.path, objects),
        )
        assert (response.status_code, missing.status_code) == (404, 404), operation
        text = response.text
        for object_id in ids:
            text = text.replace(object_id, MISSING_ID)
        assert text == missing.text, operation
        compared += real_id
    assert compared >= 6


def test_lists_never_show_someone_elses_objects(api, operations, objects, creds):
    for operation in operations:
        if operation.secured and operation.method == "get" and not operation.path_params:
            response = api.get(operation.path, headers=creds.key("bob"))
            assert response.status_code == (403 if operation.admin_only else 200), (str(operation), response.text)
            assert not [i for i in objects.values() if i in response.text], str(operation)


# -- the document -----------------------------------------------------------------------------


def test_document_declares_the_errors_of_each_route(document, operations):
    schemas = document["components"]["schemas"]
    for operation in operations:
        responses, where = operation.spec["responses"], str(operation)
        declared = {int(code) for code in responses if code.startswith("4")}
        if operation.secured:
            assert {401, 403} <= declared, where
            assert "WWW-Authenticate" in responses["401"]["headers"], where
        if operation.path_params:
            assert 404 in declared, where
        if operation.secured and operation.writes:
            assert 409 in declared, where
        if "requestBody" in operation.spec:
            assert {413, 422} <= declared, where
        if operation.secured and operation.method == "post" and not operation.path_params:
            assert 429 in declared, where  # creates and uploads
        for code in declared:
            # One error body per dialect and status, whoever refuses.
            name = responses[str(code)]["content"]["application/json"]["schema"]["$ref"].rsplit("/", 1)[1]
            assert name in schemas, (where, code)
            wanted = "OpenAIErrorBody" if operation.openai else "ValidationErrorBody" if code == 422 else "ErrorBody"
            assert name == wanted, (where, code, name)
    assert set(schemas["OpenAIErrorBody"]["properties"]) == {"error"}
    assert {"detail", "param", "code"} <= set(schemas["ErrorBody"]["properties"])


# -- raw headers, below httpx -----------------------------------------------------------------


def _asgi(app, method: str, path: str, headers: list[tuple[bytes, bytes]], body: bytes = b"") -> tuple[int, dict[bytes, bytes], bytes]:
    """One request straight into the ASGI app: header bytes exactly as given (an HTTP
    client would refuse or rewrite some of them)."""
    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method, "scheme": "http",
        "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "", "headers": headers,
        "client": ("127.0.0.1", 40000), "server": ("testserver", 80),
    }
    messages: list[dict[str, Any]] = []
    delivered = False

    async def receive() -> dict[str, Any]:
        nonlocal delivered
        if delivered:
            await asyncio.Event().wait()  # the client stays; only the response ends this
        delivered = True
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        messages.append(message)

    asyncio.run(app(scope, receive, send))
    start = next(m for m in messages if m["type"] == "http.response.start")
    content = b"".join(m.get("body", b"") for m in messages if m["type"] == "http.response.body")
    return start["status"], dict(start["headers"]), content


RAW_CREDENTIALS = {
    "nul-scheme": [(b"authorization", b"\x00")],
    "crlf-in-token": [(b"authorization", b"Bearer a\r\nb")],
    "two-authorization-headers": [(b"authorization", b"Bearer junk"), (b"authorization", b"Basic !!")],
    "high-bytes-basic": [(b"authorization", b"Basic \x80\xff\xfe")],
    "high-bytes-x-api-key": [(b"x-api-key", b"lbk_\xe9\xff\x00")],
    "cookie-garbage": [(b"cookie", b"\xff;;==;_token=\x00")],
}
RAW_OTHER_HEADERS = {
    "host-bracket": [(b"host", b"[")],
    "host-bytes": [(b"host", b"\xff\x00 x")],
    "multipart-without-boundary": [(b"content-type", b"multipart/form-data")],
    "multipart-bad-boundary": [(b"content-type", b"multipart/form-data; boundary=\xff\x00")],
    "json-bad-charset": [(b"content-type", b"application/json; charset=\xff")],
    "content-length-negative": [(b"content-length", b"-1")],
    "content-length-junk": [(b"content-length", b"\xff")],
    "accept-garbage": [(b"accept", b"\xff\x00"), (b"accept-encoding", b"\xff"), (b"range", b"bytes=\xff")],
}


def test_raw_header_bytes_never_make_a_server_error(batch_app, operations, creds):
    """Every operation with header bytes no HTTP client sends: bad credentials are 401 in
    the dialect's shape; other odd headers with a good key never 5xx."""
    import orjson

    key = (b"x-api-key", creds.keys["alice"].encode())
    problems = []
    for operation in operations:
        path = "/batch" + operation.path.format(**dict.fromkeys(operation.path_params, MISSING_ID))
        for name, headers in {**RAW_CREDENTIALS, **RAW_OTHER_HEADERS}.items():
            extra = [] if name in RAW_CREDENTIALS else [key]
            status, response_headers, body = _asgi(batch_app, operation.method.upper(), path, [*headers, *extra], b"{}")
            if status >= 500:
                problems.append(f"{operation} {name}: {status} {body[:200]!r}")
            elif name in RAW_CREDENTIALS and operation.secured:
                if status != 401 or not response_headers.get(b"www-authenticate", b"").startswith(b"Bearer"):
                    problems.append(f"{operation} {name}: {status} {response_headers}")
                elif shape := _shape_problem(operation, status, orjson.loads(body)):
                    problems.append(f"{operation} {name}: {shape}")
    assert not problems, "\n".join(problems)
