"""Every answer of the batch API matches its own OpenAPI document (/batch/openapi.json).

schemathesis generates requests for every operation of the document, valid and invalid
(path ids, query parameters, headers, bodies), and sends them in-process to the app as the
plugin serves it (mounted at /batch, under its root middleware). Credentials are drawn
from two owners' real API keys, an admin's, a viewer's JWT, and malformed or unknown ones;
path ids are often real (either owner's job or file); creates sometimes get a valid body;
Idempotency-Keys come from a small pool, so keys are used again. Each answer must be no
5xx, a status the operation declares, a content type declared for it, and headers and a
body that validate against what is declared. Creates reach the job store but trigger no
DAG run. Failures are collected over every operation (no shrinking) and reported together.
The bound: ``EXAMPLES`` per operation and mode, under a minute on a busy 2-core machine.

What no generated request reaches is sent by hand to every operation it applies to: ids
holding control characters (answered by the plugin's root middleware) and bodies over the
size limit (answered before routing).
"""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.core.failures import FailureGroup
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from tests.api.conftest import app_on, chat_lines, mounted
from tests.fuzzing import examples

pytestmark = pytest.mark.airflow

CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_headers_conformance,
          response_schema_conformance]
EXAMPLES = examples(8)  # per operation and generation mode (about 50 operations)
MODEL = "tiny-random-llama"
OWNERS = ("carol", "dave")  # of this test alone: what it makes stays out of other tests' way
# Idempotency-Keys: a small pool, so a key is used again (with another body, on another
# route), and malformed ones (empty, too long, not ASCII).
KEYS = st.sampled_from(["k1", "k2", "", "x" * 256, "caf\u00e9"])


def _requests() -> list[dict[str, Any]]:
    return [{"custom_id": "0", "body": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}}]


def _scale() -> dict[str, Any]:
    return {"content": [{"prompt": "hi", "max_tokens": 2}], "output_data_path": f"conform/{uuid.uuid4().hex}.json",
            "model_config": {"model": MODEL}}


# A valid JSON body of each create (the OpenAI batch's file is the caller's own, or not).
VALID = {
    ("POST", "/v1/jobs"): lambda file_id: {"model": MODEL, "requests": _requests()},
    ("POST", "/v1/batch/jobs"): lambda file_id: {"model": MODEL, "endpoint": "/v1/chat/completions",
                                                 "requests": _requests()},
    ("POST", "/v1/batches"): lambda file_id: {"input_file_id": file_id, "endpoint": "/v1/chat/completions",
                                              "completion_window": "24h"},
    ("POST", "/v2/batch-completions"): lambda file_id: _scale(),
    ("POST", "/v1/llm/batch-completions"): lambda file_id: _scale(),
}


@pytest.fixture(scope="module")
def keys(api_store, llm_batch_home) -> dict[str, dict[str, str]]:
    for owner in OWNERS:  # where their Scale output paths go
        (llm_batch_home / "data" / owner).mkdir(parents=True, exist_ok=True)
    return {owner: {"Authorization": f"Bearer {api_store.create_api_key(owner, 'conformance')[1]}"} for owner in OWNERS}


@pytest.fixture(scope="module")
def served(batch_app, batch_api, api_store) -> Iterator[Any]:
    """The /batch mount under the plugin's root middleware, as airflow api-server serves it;
    creates trigger no DAG run."""
    from llm_batch.api.app import UnroutablePaths
    from llm_batch.api.dag_trigger import get_trigger, run_id_for

    batch_api.dependency_overrides[get_trigger] = lambda: (lambda job_id, conf, submitted_at: run_id_for(job_id))
    yield UnroutablePaths(batch_app, prefix="/batch")
    batch_api.dependency_overrides.pop(get_trigger, None)
    for endpoint in api_store.list_webhook_endpoints():  # generated ones: nothing is ever sent to them
        if endpoint.owner in OWNERS:
            api_store.delete_webhook_endpoint(endpoint.id)


@pytest.fixture(scope="module")
def real_ids(served, keys) -> dict[str, dict[str, str]]:
    """A job and a file of each owner's."""
    from fastapi.testclient import TestClient

    ids = {}
    with TestClient(served, base_url="http://testserver/batch") as client:
        for owner in OWNERS:
            job = client.post("/v1/jobs", headers=keys[owner], json=VALID[("POST", "/v1/jobs")](None))
            file = client.post("/v1/files", headers=keys[owner], data={"purpose": "batch"},
                               files={"file": ("in.jsonl", chat_lines(1))})
            assert job.status_code == file.status_code == 200, (job.text, file.text)
            ids[owner] = {"job": job.json()["id"], "file": file.json()["id"]}
    return ids


def _credentials(keys, creds) -> st.SearchStrategy[dict[str, str]]:
    first, second = OWNERS
    return st.sampled_from([
        keys[first],
        keys[second],
        {"x-api-key": keys[first]["Authorization"].removeprefix("Bearer ")},
        creds.key("admin-key"),
        creds.jwt("vic"),  # a viewer: reads only
        {},
        {"Authorization": "Bearer lbk_" + "A" * 43},  # the shape of a key, unknown
        {"Authorization": "Bearer not-a-token"},
        {"Authorization": "Basic %%%"},
        {"Authorization": "Digest x"},
    ])


def _prepare(case, mode: GenerationMode, headers: dict[str, str], real_ids: dict[str, dict[str, str]], data) -> None:
    """Real ids, credentials, pooled keys and valid bodies on the generated `case`. The
    simplest draws (hypothesis starts there) are the first owner's own objects and key."""
    for name in case.path_parameters or {}:
        owner = data.draw(st.sampled_from([*OWNERS, None]), label=f"owner of {name}")
        if owner:
            case.path_parameters[name] = real_ids[owner]["file" if "file" in name else "job"]
    case.headers = {**(case.headers or {}), **headers}
    if "Idempotency-Key" in case.headers and data.draw(st.booleans(), label="pooled key"):
        case.headers["Idempotency-Key"] = data.draw(KEYS, label="key")
    valid = VALID.get((case.method.upper(), case.path))
    if valid and mode == GenerationMode.POSITIVE and not data.draw(st.booleans(), label="generated body"):
        case.body = valid(real_ids[data.draw(st.sampled_from(OWNERS), label="file of")]["file"])


def test_every_answer_matches_the_document(served, keys, creds, real_ids):
    started = time.monotonic()
    schema = schemathesis.openapi.from_asgi("/batch/openapi.json", served)
    # Deletes last: the real ids stay there for the other operations.
    operations = sorted((result.ok() for result in schema.get_all_operations()), key=lambda op: op.method == "delete")
    assert len(operations) >= 40
    failures: dict[str, str] = {}
    answered: set[tuple[str, int]] = set()
    for operation in operations:
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):

            @given(case=operation.as_strategy(generation_mode=mode), headers=_credentials(keys, creds), data=st.data())
            @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), database=None,
                      derandomize=True)
            def conforms(case, headers, data):
                _prepare(case, mode, headers, real_ids, data)
                response = case.call()
                answered.add((operation.label, response.status_code))
                try:
                    case.validate_response(response, checks=CHECKS)
                except FailureGroup as failure:  # collected, reported together below
                    failures.setdefault(f"{operation.label} ({mode}) {response.status_code}", str(failure)[:2000])

            try:
                conforms()
            except Unsatisfiable:
                assert mode == GenerationMode.NEGATIVE, operation.label  # nothing of it can be made invalid
    elapsed = time.monotonic() - started
    assert not failures, "\n\n".join(f"{where}:\n{what}" for where, what in failures.items())
    # Every operation was answered, many of them past the refusals too.
    assert {label for label, _ in answered} == {operation.label for operation in operations}
    succeeded = {label for label, status in answered if status < 300}
    assert len(succeeded) >= len(operations) // 2, sorted(succeeded)
    print(f"{len(operations)} operations, {len(answered)} (operation, status) pairs, {elapsed:.1f} s")


# Percent-encoded: the server hands the app the decoded path, which the mount cannot route.
CONTROL_IDS = ["a%0Ab", "%0D", "a%00b", "%7F", "a%09b"]


def _validated(operation, response, headers: dict[str, str]) -> str | None:
    """What is wrong with `response` to `operation` by its document, if anything."""
    case = operation.Case(path_parameters=dict.fromkeys(re.findall(r"{(\w+)}", operation.path), "id"), headers=headers)
    try:
        case.validate_response(response, checks=CHECKS)
    except FailureGroup as failure:
        return f"{operation.label} {response.status_code}: {str(failure)[:2000]}"
    return None


def test_ids_with_control_characters_are_answered_as_documented(served, keys):
    from fastapi.testclient import TestClient

    schema = schemathesis.openapi.from_asgi("/batch/openapi.json", served)
    problems, sent = [], 0
    with TestClient(served, base_url="http://testserver/batch", raise_server_exceptions=False) as client:
        for operation in (result.ok() for result in schema.get_all_operations()):
            for raw_id in CONTROL_IDS if "{" in operation.path else ():
                path = re.sub(r"{\w+}", raw_id, operation.path)
                response = client.request(operation.method.upper(), path, headers=keys[OWNERS[0]])
                assert response.status_code == 404, (operation.label, raw_id, response.text)
                problems.append(_validated(operation, response, keys[OWNERS[0]]))
                sent += 1
    assert sent >= 100 and not any(problems), "\n\n".join(filter(None, problems))


def test_bodies_over_the_limit_are_answered_as_documented(api_store, auth_manager, keys):
    """413 before routing (Content-Length over the limit), in the dialect the document says."""
    from fastapi.testclient import TestClient

    from llm_batch.core.config import get_settings

    settings = get_settings().model_copy(update={"max_input_bytes": 1000, "max_adapter_bytes": 1000})
    outer = mounted(app_on(api_store, auth_manager, settings), auth_manager)
    schema = schemathesis.openapi.from_asgi("/batch/openapi.json", outer)
    problems, sent = [], 0
    with TestClient(outer, base_url="http://testserver/batch", raise_server_exceptions=False) as client:
        for operation in (result.ok() for result in schema.get_all_operations()):
            media_types = list(operation.definition.raw.get("requestBody", {}).get("content", {}))
            if not media_types:
                continue
            content_type = "multipart/form-data; boundary=x" if media_types[0].startswith("multipart/") else media_types[0]
            path = re.sub(r"{\w+}", "job_1", operation.path)
            response = client.request(operation.method.upper(), path, content=b"x" * (2 * 1024**2),
                                      headers={**keys[OWNERS[0]], "content-type": content_type})
            assert response.status_code == 413, (operation.label, response.text)
            problems.append(_validated(operation, response, keys[OWNERS[0]]))
            sent += 1
    assert sent >= 12 and not any(problems), "\n\n".join(filter(None, problems))


def test_the_checks_refuse_an_undeclared_body(served, keys):
    """The checks bite: Airflow's bare 404 (what an unroutable id got) fails them."""
    from fastapi.testclient import TestClient

    operation = schemathesis.openapi.from_asgi("/batch/openapi.json", served)["/v1/jobs/{job_id}"]["GET"]
    with TestClient(served, base_url="http://testserver/batch") as client:
        real = client.get("/v1/jobs/job_missing", headers=keys[OWNERS[0]])
    assert real.status_code == 404 and _validated(operation, real, keys[OWNERS[0]]) is None
    bare = type(real)(404, json={"detail": "Not Found"}, request=real.request)
    bare.elapsed = real.elapsed
    assert "violates schema" in (_validated(operation, bare, keys[OWNERS[0]]) or "")
