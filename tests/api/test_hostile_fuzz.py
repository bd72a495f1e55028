"""A hostile user against every create and update route of every dialect, property-based.

Each write route of the app (enumerated from ``app.routes``, so a new route is attacked
too, or this test says it has no sample body) gets valid-looking bodies with a hostile value
planted at a random place: lone surrogates, nesting past any sane depth, integers past 64
bits, NaN, engine arguments vLLM knows (code, paths, URLs among them), paths and URLs in
many spellings, markdown and HTML, huge strings; and ids that are hostile or another
owner's. Asserted for every request: no 5xx; a refused request leaves the job store
byte-identical (jobs, files, webhook endpoints); and afterwards every run of the batch DAG
has a conf that is strict JSON (Airflow's scheduler stops on one it cannot serialise).
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

import pytest
from hypothesis import HealthCheck, given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

from llm_batch.core import strict_json

pytestmark = pytest.mark.airflow

MODEL = "tiny-random-llama"
WRITES = {"POST", "PUT", "PATCH", "DELETE"}
# An id another owner (bob) holds, per kind of path parameter; filled by the fixture.
BOB: dict[str, str] = {}


def _chat(custom_id: str = "a") -> dict[str, Any]:
    return {"custom_id": custom_id, "body": {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}}


def samples(own_dir: str, file_id: str) -> dict[tuple[str, str], Any]:
    """A body each write route accepts (None: the route takes no JSON body)."""
    scale_v2 = {"output_data_path": f"{own_dir}/fuzz-out.json", "model_config": {"model": MODEL, "max_model_len": 256},
                "content": [{"prompt": "hi", "max_tokens": 2}], "labels": {"team": "a"}, "priority": "normal"}
    return {
        ("POST", "/v1/files"): "multipart",
        ("DELETE", "/v1/files/{file_id}"): None,
        ("POST", "/v1/adapters"): "multipart",
        ("DELETE", "/v1/adapters/{name}"): None,
        ("POST", "/v1/batches"): {"input_file_id": file_id, "endpoint": "/v1/chat/completions",
                                  "completion_window": "24h", "metadata": {"k": "v"}},
        ("POST", "/v1/batches/{batch_id}/cancel"): None,
        ("POST", "/v1/batch/jobs"): {"model": MODEL, "endpoint": "/v1/chat/completions", "requests": [_chat()],
                                     "metadata": {"k": "v"}, "timeout_hours": 1},
        ("POST", "/v1/batch/jobs/{job_id}/cancel"): None,
        ("DELETE", "/v1/batch/jobs/{job_id}"): None,
        ("POST", "/v2/batch-completions"): scale_v2,
        ("POST", "/v2/batch-completions/{batch_completion_id}/actions/cancel"): None,
        ("POST", "/v1/llm/batch-completions"): {
            "output_data_path": f"{own_dir}/fuzz-v1.json", "model_config": {"model": MODEL, "labels": {}},
            "content": {"prompts": ["hi"], "max_new_tokens": 2, "temperature": 0.0}},
        ("POST", "/v1/jobs"): {"model": MODEL, "endpoint": "/v1/chat/completions", "requests": [_chat()],
                               "model_config": {"max_model_len": 256, "engine_args": {"max_num_seqs": 2}},
                               "labels": {"team": "a"}, "priority": "normal"},
        ("POST", "/v1/jobs/{job_id}/cancel"): None,
        ("POST", "/v1/jobs/{job_id}/retry"): None,
        ("POST", "/v1/jobs/{job_id}/rerun"): None,
        ("POST", "/v2/batch-completions/{batch_completion_id}"): {"priority": "high"},
        ("POST", "/v1/webhooks"): {"url": "https://hooks.example.com/x", "events": ["batch.completed"]},
        ("DELETE", "/v1/webhooks/{endpoint_id}"): None,
        ("POST", "/v1/webhooks/{endpoint_id}/test"): None,
        ("POST", "/v1/webhook_endpoints"): {"url": "https://hooks.example.com/y", "name": "n",
                                            "event_types": ["batch.completed"]},
        ("POST", "/v1/webhook_endpoints/{webhook_endpoint_id}"): {"name": "m"},
        ("DELETE", "/v1/webhook_endpoints/{webhook_endpoint_id}"): None,
        ("POST", "/v1/webhook_endpoints/{webhook_endpoint_id}/rotate_secret"): None,
        ("POST", "/v1/webhook_endpoints/{webhook_endpoint_id}/test"): None,
        ("POST", "/ui/api/jobs/{job_id}/cancel"): None,
    }


def write_routes(app) -> list[tuple[str, str]]:
    from fastapi.routing import APIRoute

    return sorted((method, route.path) for route in app.routes if isinstance(route, APIRoute)
                  for method in route.methods & WRITES)


# --- hostile values ---------------------------------------------------------------------

def _nest(depth: int) -> Any:
    value: Any = "deep"
    for i in range(depth):
        value = [value] if i % 2 else {"d": value}
    return value


def _engine_arg_names() -> list[str]:
    from vllm.engine.arg_utils import EngineArgs

    return [f.name for f in dataclasses.fields(EngineArgs)]


SPELLINGS = ["../../etc/passwd", "/etc/passwd", "file:///etc/passwd", "%2e%2e/%2e%2e/etc", "~root/.ssh",
             "s3://other-bucket/x", "data/bob/in.json", "/proc/self/environ", "\\\\server\\share", "C:\\x",
             "http://127.0.0.1:1/", "http://[::ffff:127.0.0.1]/", "http://2130706433/", "http://[2002:7f00:1::]/",
             "http://[fec0::1]/", "jobs.db-wal", "a\x00b", "x" * 5000]
ECHOED = ["![x](http://127.0.0.1:9/leak)", "<script>alert(1)</script>", "<img src=x onerror=alert(1)>",
          "[a](javascript:alert(1))", "`code` *b* _i_ # h", "{{ 7*7 }}", "${jndi:ldap://x}"]


def hostile_values(engine_args: list[str]) -> st.SearchStrategy[Any]:
    scalar = (
        st.sampled_from(["\ud800", "a\udfffb", "\udc00\ud800"])
        | st.text(st.characters(categories=["Cs"]), min_size=1, max_size=3)
        | st.integers(min_value=2**64, max_value=2**200) | st.integers(max_value=-(2**63) - 1, min_value=-(2**100))
        | st.sampled_from([math.nan, math.inf, -math.inf])
        | st.sampled_from(SPELLINGS + ECHOED)
        | st.integers(min_value=60, max_value=400).map(_nest)
        | st.text(max_size=30) | st.integers() | st.floats() | st.booleans() | st.none()
    )
    engine = st.dictionaries(st.sampled_from(engine_args), scalar | st.sampled_from(SPELLINGS), min_size=1, max_size=3)
    plain = st.recursive(scalar, lambda inner: st.lists(inner, max_size=3)
                         | st.dictionaries(st.text(max_size=6) | st.sampled_from(["\ud800"]), inner, max_size=3),
                         max_leaves=6)
    return scalar | engine | plain | engine.map(lambda args: {"engine_args": args})


@st.composite
def planted(draw, base: Any, hostile: st.SearchStrategy[Any]) -> Any:
    """`base` with one hostile value put at a random place (a field it has, or a new one)."""
    if not isinstance(base, (dict, list)) or draw(st.integers(0, 3)) == 0:
        return draw(hostile)
    if isinstance(base, list):
        if not base:
            return [draw(hostile)]
        index = draw(st.integers(0, len(base) - 1))
        return [*base[:index], draw(planted(base[index], hostile)), *base[index + 1:]]
    keys = sorted(base) + ["engine_args", "metadata", "labels", "model_config", "extra\ud800"]
    key = draw(st.sampled_from(keys))
    return {**base, key: draw(planted(base.get(key, {}), hostile))}


HOSTILE_IDS = ["../../etc/passwd", "%2e%2e%2fjobs.db", "\ud800", "x" * 3000, "batch_" + "0" * 40, "' OR 1=1 --",
               "job_\u212a", "ALICE", "file-..", "%00", "%ED%A0%80"]


def _dumps(body: Any) -> bytes:
    """JSON as a hostile client writes it: lone surrogates as escapes, NaN, any integer."""
    import sys

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 5000))
    try:
        return json.dumps(body, allow_nan=True).encode()
    finally:
        sys.setrecursionlimit(limit)


# --- the fixture: the attacker's own file, bob's objects -------------------------------

@pytest.fixture(scope="module")
def arena(auth_manager, airflow_dags_in_db, sqlite_store_template, tmp_path_factory, llm_batch_home):
    """The app on a job store of this module's own (a copy of the migrated template): every
    request's before-and-after snapshot reads only what this module wrote, whatever ran before."""
    from fastapi.testclient import TestClient

    from llm_batch.infra.jobstore import JobStore
    from tests.api.conftest import app_on, chat_lines, mounted
    from tests.fixtures.jobstore import sqlite_copy

    store = JobStore(sqlite_copy(sqlite_store_template, tmp_path_factory.mktemp("fuzz-store")))
    app = app_on(store, auth_manager)
    # An owner of its own: what the attack makes (webhook endpoints, jobs); bob's objects beside.
    own = {"Authorization": f"Bearer {store.create_api_key('mallory', 'fuzz key')[1]}"}
    bob = {"Authorization": f"Bearer {store.create_api_key('bob', 'fuzz key')[1]}"}
    own_dir = llm_batch_home / "data" / "mallory"
    own_dir.mkdir(parents=True, exist_ok=True)
    with TestClient(mounted(app, auth_manager), base_url="http://testserver/batch", raise_server_exceptions=False) as client:
        uploaded = client.post("/v1/files", headers=own, data={"purpose": "batch"},
                               files={"file": ("in.jsonl", chat_lines(2))})
        assert uploaded.status_code == 200, uploaded.text
        bob_job = client.post("/v1/jobs", headers=bob, json={
            "model": MODEL, "endpoint": "/v1/chat/completions", "requests": [_chat()]})
        assert bob_job.status_code == 200, bob_job.text
        bob_file = client.post("/v1/files", headers=bob, data={"purpose": "batch"},
                               files={"file": ("b.jsonl", chat_lines(1))})
        BOB.update(job=bob_job.json()["id"], file=bob_file.json()["id"])
        yield {"client": client, "own_dir": str(own_dir), "file_id": uploaded.json()["id"], "headers": own,
               "store": store, "app": app}
    store.engine.dispose()


def store_snapshot(store) -> dict[str, list[tuple]]:
    from sqlalchemy import text

    with store.engine.connect() as connection:
        return {table: [tuple(row) for row in connection.execute(text(f"SELECT * FROM {table} ORDER BY 1"))]
                for table in ("jobs", "files", "webhook_endpoints")}


def test_every_write_route_has_a_sample_body(arena):
    table = samples(arena["own_dir"], arena["file_id"])
    missing = [route for route in write_routes(arena["app"]) if route not in table]
    assert not missing, f"write routes the fuzzer has no sample for (add them to samples()): {missing}"


def _path(template: str, draw_id: str) -> str:
    import re

    return re.sub(r"\{[^}]+\}", draw_id, template)


@pytest.mark.parametrize("seed_route", range(1))
def test_hostile_input_on_every_write_route(arena, seed_route):
    client, table = arena["client"], samples(arena["own_dir"], arena["file_id"])
    hostile = hostile_values(_engine_arg_names())
    routes = [route for route in write_routes(arena["app"]) if route in table]
    seen: dict[tuple[str, str], int] = {}
    statuses: set[int] = set()

    # The control, before the draws (they may fill the owner's webhook limit): the same
    # credentials and a sample without a hostile value pass, so the refusals below are the
    # hostile values' doing. (Whether one of the 600 draws also passes is left to chance.)
    control = client.post("/v1/webhooks", headers=arena["headers"], json=table[("POST", "/v1/webhooks")])
    assert control.status_code == 200, control.text

    # All 600 in every lane: the test asserts every route was attacked (~40 routes drawn at random).
    @hsettings(max_examples=600, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(data=st.data())
    def attack(data):
        method, template = data.draw(st.sampled_from(routes))
        sample = table[(method, template)]
        ident = data.draw(st.sampled_from([BOB["job"], BOB["file"], *HOSTILE_IDS]))
        from urllib.parse import quote

        path = _path(template, quote(ident.encode("utf-8", "surrogatepass"), safe="%"))
        headers = {**arena["headers"], "Idempotency-Key": data.draw(st.sampled_from(["k1", "x" * 300, b"\xc3\xa9\xff", "a b\tc"]))}
        before = store_snapshot(arena["store"])
        if sample == "multipart":
            purpose = data.draw(st.sampled_from(["batch", "ocr", "fine-tune", "../x", "batch\x00"]))
            name = data.draw(st.sampled_from(SPELLINGS + ECHOED + ["in.jsonl"]))
            content = data.draw(st.sampled_from([_dumps(_chat()) + b"\n", _dumps(_nest(300)) + b"\n",
                                                 b'{"custom_id": "\\ud800", "body": {}}\n', b"\xff\xfe\n"]))
            response = client.post(path, headers=headers, data={"purpose": purpose}, files={"file": (name, content)})
        elif sample is None:
            response = client.request(method, path, headers=headers)
        else:
            body = data.draw(planted(sample, hostile))
            response = client.request(method, path, headers={**headers, "content-type": "application/json"},
                                      content=_dumps(body))
        seen[(method, template)] = seen.get((method, template), 0) + 1
        statuses.add(response.status_code)
        assert response.status_code < 500, f"{method} {path}: {response.status_code} {response.text[:300]}"
        if response.status_code >= 400:
            assert store_snapshot(arena["store"]) == before, f"{method} {path} was refused but changed the store"

    attack()
    assert set(seen) == set(routes), f"routes never attacked: {set(routes) - set(seen)}"
    assert 400 in statuses, f"the attack was never refused as invalid: {statuses}"
    assert_every_run_conf_is_strict_json()


def assert_every_run_conf_is_strict_json() -> None:
    from airflow.models.dagrun import DagRun
    from airflow.utils.session import create_session

    with create_session() as session:
        confs = [(run.run_id, run.conf) for run in session.query(DagRun).filter(DagRun.dag_id == "batch_inference")]
    assert confs
    for run_id, conf in confs:
        assert strict_json.problem(conf or {}) is None, f"run {run_id} has a conf Airflow may not serialise"


# --- the reproductions of the hostile probe ----------------------------------------------

@pytest.mark.parametrize("route, body", [
    ("/v1/jobs", {"model": MODEL, "endpoint": "/v1/chat/completions", "requests": [_chat()],
                  "model_config": {"engine_args": {"reasoning_parser_plugin": "/data/alice/evil.py"}}}),
    ("/v1/jobs", {"model": MODEL, "endpoint": "/v1/chat/completions", "requests": [_chat()],
                  "model_config": {"engine_args": {"scheduler_cls": "evil.Scheduler"}}}),
    ("/v1/jobs", {"model": MODEL, "endpoint": "/v1/chat/completions", "requests": [_chat()],
                  "model_config": {"engine_args": {"compilation_config": {"backend": "evil.backend"}}}}),
    ("/v2/batch-completions", {"output_data_path": "{alice}/x.json", "content": [{"prompt": "hi", "max_tokens": 2}],
                               "model_config": {"model": MODEL, "engine_args": {"generation_config": "/etc"}}}),
    ("/v2/batch-completions", {"output_data_path": "{alice}/x.json", "content": [{"prompt": "hi", "max_tokens": 2}],
                               "model_config": {"model": MODEL, "engine_args": {"otlp_traces_endpoint": "http://127.0.0.1:1"}}}),
])
def test_engine_arguments_that_run_code_are_refused_naming_them(arena, route, body):
    body = json.loads(json.dumps(body).replace("{alice}", arena["own_dir"]))
    before = store_snapshot(arena["store"])
    response = arena["client"].post(route, headers=arena["headers"], json=body)
    assert response.status_code in (400, 422), response.text
    assert "may not be set by a job" in response.text
    assert store_snapshot(arena["store"]) == before


@pytest.mark.parametrize("route, body", [
    ("/v1/jobs", '{"model": "%s", "endpoint": "/v1/chat/completions", "requests": [{"custom_id": "a", "body": '
                 '{"messages": [{"role": "user", "content": "hi"}]}}], "model_config": {"max_model_len": "\\ud800"}}' % MODEL),
    ("/v1/jobs", '{"model": "%s", "endpoint": "/v1/chat/completions", "requests": [{"custom_id": "a", "body": {}}],'
                 ' "labels": {"\\udfff": "x"}}' % MODEL),
    ("/v1/batch/jobs", '{"model": "%s", "endpoint": "/v1/chat/completions", "requests": [], "metadata": {"k": "\\ud800"}}' % MODEL),
    ("/v2/batch-completions", '{"output_data_path": "x.json", "content": [], "model_config": {"model": "\\ud800"}}'),
    ("/v1/batches", '{"input_file_id": "f", "endpoint": "/v1/chat/completions", "completion_window": "24h", '
                    '"metadata": {"k": NaN}}'),
    ("/v1/jobs", '{"model": "%s", "priority": 123456789012345678901234567890}' % MODEL),
])
def test_what_python_parses_and_strict_json_refuses_is_a_precise_400(arena, route, body):
    before = store_snapshot(arena["store"])
    response = arena["client"].post(route, headers={**arena["headers"], "content-type": "application/json"},
                                    content=body.encode())
    assert response.status_code == 400, response.text
    assert "not strict JSON" in response.text
    assert store_snapshot(arena["store"]) == before


@pytest.mark.parametrize("route", ["/v1/jobs", "/v1/batch/jobs", "/v2/batch-completions"])
@pytest.mark.parametrize("depth", [64, 253, 600])
def test_deep_nesting_is_refused_naming_the_limit(arena, route, depth):
    body = {"model": MODEL, "requests": [{"custom_id": "a", "body": _nest(depth)}], "content": [_nest(depth)]}
    response = arena["client"].post(route, headers={**arena["headers"], "content-type": "application/json"},
                                    content=_dumps(body))
    assert response.status_code == 400, response.text
    assert f"nested deeper than {strict_json.MAX_DEPTH} levels" in response.text
