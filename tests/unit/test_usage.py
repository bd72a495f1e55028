"""Usage accounting: ``JobStore.usage`` sums (SQLite and PostgreSQL, as tests/unit/test_jobstore.py)
and the ``llm-batch usage`` command against a stub API (the real API: tests/api/test_usage_api.py)."""

from __future__ import annotations

import argparse
import json
from datetime import UTC, datetime, timedelta

import httpx
import pytest

from llm_batch.cli.main import main
from llm_batch.cli.usage import parse_since
from llm_batch.core.snapshots import UsageRow
from llm_batch.infra import api_client as client_module
from llm_batch.infra.api_client import BatchClient
from llm_batch.infra.jobstore import JobStore
from tests.fixtures.jobstore import store_url_of

CHAT = "/v1/chat/completions"
T0 = datetime(2026, 1, 1, tzinfo=UTC)


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def store(request: pytest.FixtureRequest):
    store = JobStore(store_url_of(request, request.param))
    yield store
    store.close()


def _job(store: JobStore, *, owner: str, model: str, created_at: datetime, shards: list[dict], total: int, **fields):
    """A job with these shards' reports (their counts and usage become the job's) and `total`."""
    job = store.create_job(dialect="openai", endpoint=CHAT, model=model, owner=owner, created_at=created_at, **fields)
    for index, shard in enumerate(shards):
        store.report_shard(job.id, index, state="done", **shard)
    store.set_counts(job.id, total=total)
    return job


@pytest.fixture
def jobs(store: JobStore) -> dict[str, str]:
    """Four jobs of known usage (GPU seconds: A 15 s x 2 GPUs, B 4 s x 1 (no gpus named),
    C 3 s x 0 GPUs, D 100 s x 1); D was created ten days before the others."""
    a = _job(store, owner="alice", model="m1", created_at=T0 + timedelta(hours=1), total=5,
             labels={"team": "a", "env": "prod"}, resources={"gpus": 2, "gpu_type": "nvidia-ampere-a100"},
             shards=[dict(done=3, succeeded=3, prompt_tokens=100, completion_tokens=40, cached_prompt_tokens=10,
                          engine_seconds=10.0),
                     dict(done=2, succeeded=1, failed=1, prompt_tokens=50, completion_tokens=20, engine_seconds=5.0)])
    b = _job(store, owner="bob", model="m1", created_at=T0 + timedelta(hours=2), total=4, labels={"team": "a"},
             shards=[dict(done=4, succeeded=4, prompt_tokens=80, completion_tokens=16, cached_prompt_tokens=8,
                          engine_seconds=4.0)])
    # The merge's exact sums with the lines the result cache answered (B: 2 lines, 50 tokens).
    store.set_usage(b.id, prompt_tokens=80, completion_tokens=16, cached_prompt_tokens=8, reasoning_tokens=0,
                    result_cache_hits=2, result_cache_tokens=50)
    c = _job(store, owner="alice", model="m2", created_at=T0 + timedelta(hours=3), total=2, resources={"gpus": 0},
             shards=[dict(done=2, succeeded=1, failed=1, prompt_tokens=20, completion_tokens=2, engine_seconds=3.0)])
    # The merge's exact sums: the cached count unknown (adds 0), 7 reasoning tokens.
    # Its failed line failed the job's output check after 3 retries (30 tokens thrown away).
    store.set_usage(c.id, prompt_tokens=20, completion_tokens=2, cached_prompt_tokens=None, reasoning_tokens=7,
                    invalid_output=1, output_retries=3, retry_tokens=30)
    d = _job(store, owner="alice", model="m1", created_at=T0 - timedelta(days=10), total=1,
             labels={"team": "b", "n": 1}, resources={"gpus": 1},
             shards=[dict(done=1, succeeded=1, prompt_tokens=1000, completion_tokens=1000, engine_seconds=100.0)])
    store.set_usage(d.id, prompt_tokens=1000, completion_tokens=1000, cached_prompt_tokens=0, reasoning_tokens=0,
                    result_cache_hits=1, result_cache_tokens=2000)
    return {"a": a.id, "b": b.id, "c": c.id, "d": d.id}


# Each job's sums, as a UsageRow of one job (the group is filled in by _sum).
_ONE = dict(group="", jobs=1)
A = UsageRow(**_ONE, requests_total=5, requests_succeeded=4, requests_failed=1, prompt_tokens=150,
             completion_tokens=60, cached_prompt_tokens=10, engine_seconds=15.0, gpu_seconds=30.0)
B = UsageRow(**_ONE, requests_total=4, requests_succeeded=4, prompt_tokens=80, completion_tokens=16,
             cached_prompt_tokens=8, cached_requests=2, cached_tokens=50, engine_seconds=4.0, gpu_seconds=4.0)
C = UsageRow(**_ONE, requests_total=2, requests_succeeded=1, requests_failed=1, prompt_tokens=20,
             completion_tokens=2, reasoning_tokens=7, invalid_output=1, output_retries=3, retry_tokens=30,
             engine_seconds=3.0)
D = UsageRow(**_ONE, requests_total=1, requests_succeeded=1, prompt_tokens=1000, completion_tokens=1000,
             cached_requests=1, cached_tokens=2000, engine_seconds=100.0, gpu_seconds=100.0)


def _sum(group: str, *rows: UsageRow) -> UsageRow:
    names = [name for name in UsageRow.__dataclass_fields__ if name != "group"]
    return UsageRow(group, *(sum(getattr(r, name) for r in rows) for name in names))


def test_totals_without_grouping(store, jobs):
    assert store.usage() == [_sum("(all)", A, B, C, D)]
    assert store.usage(since=T0) == [_sum("(all)", A, B, C)]


def test_by_owner_and_by_model_sum_each_group(store, jobs):
    assert store.usage("owner") == [_sum("alice", A, C, D), _sum("bob", B)]
    assert store.usage("model") == [_sum("m1", A, B, D), _sum("m2", C)]


def test_since_counts_jobs_created_at_or_after_it(store, jobs):
    assert store.usage("owner", since=T0) == [_sum("alice", A, C), _sum("bob", B)]
    # A was created exactly then: counted; B and C later.
    assert store.usage("model", since=T0 + timedelta(hours=1)) == [_sum("m1", A, B), _sum("m2", C)]
    assert store.usage("model", since=T0 + timedelta(hours=2, seconds=1)) == [_sum("m2", C)]
    assert store.usage("owner", since=T0 + timedelta(days=1)) == []


def test_by_label_fans_a_job_out_to_each_of_its_pairs(store, jobs):
    assert store.usage("label") == [
        _sum("(none)", C), _sum("env=prod", A), _sum("n=1", D), _sum("team=a", A, B), _sum("team=b", D),
    ]
    assert store.usage("label", since=T0) == [_sum("(none)", C), _sum("env=prod", A), _sum("team=a", A, B)]


def test_owner_restricts_every_grouping(store, jobs):
    assert store.usage(owner="bob") == [_sum("(all)", B)]
    assert store.usage("label", owner="bob") == [_sum("team=a", B)]
    assert store.usage("model", since=T0, owner="alice") == [_sum("m1", A), _sum("m2", C)]


def test_gpu_seconds_are_engine_seconds_times_the_jobs_gpus(store, jobs):
    rows = {r.group: r for r in store.usage("owner")}
    assert (rows["alice"].engine_seconds, rows["alice"].gpu_seconds) == (118.0, 130.0)  # 15x2 + 3x0 + 100x1
    assert (rows["bob"].engine_seconds, rows["bob"].gpu_seconds) == (4.0, 4.0)  # no gpus named: 1


def test_an_empty_store_has_one_zero_total_and_no_groups(store):
    assert store.usage() == [UsageRow("(all)")]
    assert store.usage("owner") == store.usage("label") == []


def test_bad_arguments_are_refused(store):
    with pytest.raises(ValueError, match="cannot group usage by 'team'"):
        store.usage("team")
    with pytest.raises(ValueError, match="naive datetime"):
        store.usage(since=datetime(2026, 1, 1))


# -- the command ------------------------------------------------------------------------------

REPORT = {
    "object": "list", "by": "label", "since": "2026-01-01T00:00:00Z",
    "data": [
        {"group": "(none)", "jobs": 1, "requests": {"total": 2, "succeeded": 1, "failed": 1}, "prompt_tokens": 20,
         "completion_tokens": 2, "cached_prompt_tokens": 0, "reasoning_tokens": 7, "cached_requests": 0,
         "cached_tokens": 0, "invalid_output": 1, "output_retries": 3, "retry_tokens": 30, "engine_seconds": 3.0,
         "gpu_seconds": 0.0},
        {"group": "team=a", "jobs": 2, "requests": {"total": 9, "succeeded": 8, "failed": 1}, "prompt_tokens": 23000,
         "completion_tokens": 76, "cached_prompt_tokens": 18, "reasoning_tokens": 0, "engine_seconds": 19.0,
         "gpu_seconds": 34.0},
    ],
}


@pytest.fixture
def api(monkeypatch):
    """A stub API behind BatchClient.from_env: answers GET /v1/usage with `answer` (REPORT)."""

    class Stub:
        answer = httpx.Response(200, json=REPORT)
        seen: list[httpx.Request] = []

        def __call__(self, request: httpx.Request) -> httpx.Response:
            self.seen.append(request)
            if (request.method, request.url.path) != ("GET", "/batch/v1/usage"):
                return httpx.Response(404, json={"detail": "no route"})
            return self.answer

    stub = Stub()
    monkeypatch.setattr(client_module.BatchClient, "from_env", classmethod(
        lambda cls, settings=None: BatchClient("http://stub/batch", "key-1", transport=httpx.MockTransport(stub))))
    return stub


def test_usage_prints_a_row_per_group(api, capsys):
    assert main(["usage", "--by", "label", "--since", "2026-01-01"]) == 0
    out, err = capsys.readouterr()
    assert dict(api.seen[0].url.params) == {"by": "label", "since": "2026-01-01T00:00:00+00:00"}
    header, *rows = out.splitlines()
    assert header.split()[:4] == ["LABEL", "JOBS", "REQUESTS", "SUCCEEDED"]
    assert rows[0].split() == ["(none)", "1", "2", "1", "1", "20", "2", "0", "0", "3", "3.0", "0.0"]
    # A server without the result cache's and output check's figures: 0 in their columns.
    assert rows[1].split() == ["team=a", "2", "9", "8", "1", "23,000", "76", "18", "0", "0", "19.0", "34.0"]
    assert "usage by label of jobs created since 2026-01-01T00:00:00Z" in err


def test_usage_json_is_the_apis_answer(api, capsys):
    assert main(["usage", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == REPORT
    assert dict(api.seen[0].url.params) == {}


def test_a_refusal_is_a_usage_error(api, capsys):
    api.answer = httpx.Response(403, json={"detail": "'alice' is not an admin", "param": None, "code": "forbidden"})
    assert main(["usage", "--by", "owner"]) == 2
    assert "error: HTTP 403: 'alice' is not an admin" in capsys.readouterr().err


def test_no_groups_says_so(api, capsys):
    api.answer = httpx.Response(200, json={"object": "list", "by": "owner", "since": None, "data": []})
    assert main(["usage", "--by", "owner"]) == 0
    out, err = capsys.readouterr()
    assert out == "" and "no jobs match" in err


@pytest.mark.parametrize(
    ("text", "expected"),
    [("7d", T0 - timedelta(days=7)), ("12h", T0 - timedelta(hours=12)), ("30m", T0 - timedelta(minutes=30)),
     ("2w", T0 - timedelta(weeks=2)), ("2026-11-01", datetime(2026, 11, 1, tzinfo=UTC)),
     ("2026-11-01T08:00:00+02:00", datetime(2026, 11, 1, 6, tzinfo=UTC)),
     ("2026-11-01T08:00Z", datetime(2026, 11, 1, 8, tzinfo=UTC))],
)
def test_since_takes_an_age_a_date_or_a_time(text, expected):
    assert parse_since(text, now=T0) == expected


@pytest.mark.parametrize("text", ["yesterday", "7x", "-7d", "", "2026-13-01"])
def test_since_refuses_anything_else(text):
    with pytest.raises(argparse.ArgumentTypeError, match="not an age"):
        parse_since(text, now=T0)
