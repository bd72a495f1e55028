"""The pipeline steps without Airflow: a real SQLite job store and local storage; shard
results are written with the real results writer in place of a worker (the worker itself
runs in tests/dags). Checks status moves, counts, outputs, ids and reasons."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import uuid
from datetime import timedelta
from pathlib import Path

import orjson
import pytest

from llm_batch.airflow import lanes
from llm_batch.core import exit_codes, jobs, placement, run_conf
from llm_batch.core.config import Settings
from llm_batch.core.job_spec import JobInput, JobOptions
from llm_batch.core.jobs import JobStatus
from llm_batch.core.records import ResultRecord
from llm_batch.infra import storage
from llm_batch.infra.jobstore import JobStore, utcnow
from llm_batch.infra.progress import ShardProgress
from llm_batch.infra.results import ResultsWriter
from llm_batch.pipeline import housekeeping, shard_task, steps
from llm_batch.pipeline.validation import STOP_CHECK_ITEMS


@pytest.fixture
def settings() -> Settings:
    return Settings()


@pytest.fixture
def store(sqlite_store_url: str) -> JobStore:
    store = JobStore(sqlite_store_url)
    yield store
    store.close()


def _chat(i: int) -> bytes:
    return orjson.dumps({"custom_id": f"req-{i}", "body": {"messages": [{"role": "user", "content": f"q{i}"}], "max_tokens": 4}})


def _input(settings: Settings, lines: list[bytes]) -> str:
    # The default owner's own folder of the user root (llm_batch.infra.user_paths).
    path = settings.local_roots[0] / run_conf.DEFAULT_OWNER / f"input-{uuid.uuid4().hex[:8]}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"\n".join(lines) + b"\n")
    return str(path)


def _conf(settings: Settings, n: int = 6, bad: tuple[int, ...] = (), **extra) -> dict:
    lines = [b"{broken" if i in bad else _chat(i) for i in range(n)]
    return {"input_uri": _input(settings, lines), "model": "tiny-random-llama", **extra}


def _run_worker(task: dict, finish: int | None = None) -> None:
    """Stand-in for a worker: results for the first `finish` requests of the shard."""
    shard = shard_task.ShardTask.model_validate(task)
    requests = [orjson.loads(line) for line in storage.read_bytes(shard.requests_uri).splitlines()]
    with ResultsWriter.open(shard.results_uri) as writer:
        for request in requests[:finish]:
            writer.write(ResultRecord(index=request["index"], custom_id=request["custom_id"], status_code=200,
                                      body={"object": "chat.completion", "usage": USAGE}))
    done = len(requests[:finish])
    storage.write_bytes(shard.progress_uri, ShardProgress(
        job_id=shard.job_id, shard=shard.shard, total=len(requests), done=done, succeeded=done,
        prompt_tokens=5 * done, completion_tokens=2 * done, cached_prompt_tokens=done, engine_seconds=1.5,
        state="done").model_dump_json().encode())


USAGE = {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7, "prompt_tokens_details": {"cached_tokens": 1}}


def _run_id() -> str:
    """Job ids derive from run ids and the work folder outlives each test's store: unique."""
    return f"manual__{uuid.uuid4().hex}"


def _through_plan(store, settings, conf, run_id: str | None = None) -> tuple[str, list[dict]]:
    job_id = steps.register(store, settings, conf, run_id or _run_id())
    steps.validate(store, settings, job_id)
    return job_id, [task.model_dump() for task in steps.plan(store, settings, job_id)]


# -- lanes and priorities ------------------------------------------------------------------


def test_lanes_cover_every_pool_and_band(settings):
    assert lanes.lane_for(settings, None, "low") == lanes.Lane(settings.local_pool, "low", 1)
    assert lanes.default_lane(settings) == lanes.Lane(settings.local_pool, "normal", 10)
    k8s = settings.model_copy(update={"shard_runner": "kubernetes"})
    seen = {lanes.lane_for(k8s, g, band) for g in placement.GPU_TYPES for band in ("low", "normal", "high")}
    assert len(seen) == len(placement.GPU_TYPES) * 3
    assert {lane.pool for lane in seen} == {lanes.gpu_pool(g) for g in placement.GPU_TYPES}
    assert {p.name for p in lanes.pool_specs(settings)} == {settings.local_pool} | {lane.pool for lane in seen}
    assert {p.name for p in lanes.runner_pool_specs(k8s)} == {lane.pool for lane in seen}
    assert [p.name for p in lanes.runner_pool_specs(settings)] == [settings.local_pool]


@pytest.mark.parametrize(
    "conf",
    [None, [], "high", {"priority": True}, {"priority": ["high"]}, {"gpu_type": 7}, {"gpu_type": "no-such-gpu"},
     {"priority": None, "gpu_type": None}],
)
def test_a_runs_lane_from_a_conf_it_cannot_use_is_the_default(settings, conf):
    k8s = settings.model_copy(update={"shard_runner": "kubernetes"})
    assert lanes.lane_of_run(k8s, conf) == lanes.default_lane(k8s)
    assert lanes.lane_of_run(settings, conf) == lanes.default_lane(settings)


def test_a_runs_lane_follows_its_conf(settings):
    k8s = settings.model_copy(update={"shard_runner": "kubernetes"})
    lane = lanes.lane_of_run(k8s, {"gpu_type": placement.GPU_TYPES[2], "priority": "high"})
    assert lane == lanes.Lane(lanes.gpu_pool(placement.GPU_TYPES[2]), "high", 100)
    assert lanes.lane_of_run(settings, {"priority": 150, "gpu_type": placement.GPU_TYPES[2]}) == lanes.Lane(
        settings.local_pool, "high", 100)


@pytest.mark.parametrize(
    ("priority", "band"),
    [(None, "normal"), (0, "normal"), ("HIGH", "high"), ("low", "low"), (5, "low"), (10, "normal"), ("150", "high"), ("urgent", "normal")],
)
def test_priority_band(settings, priority, band):
    assert placement.priority_band(settings, priority) == band


# -- register and validate -----------------------------------------------------------------


def test_register_makes_a_job_from_the_conf(store, settings):
    conf = _conf(settings, data_parallelism=2, priority="high", gpu_type="nvidia-tesla-t4", max_runtime_sec=600)
    run_id = _run_id()
    job_id = steps.register(store, settings, conf, run_id)
    job = store.get_job(job_id)
    assert job_id == run_conf.run_job_id({}, run_id)  # derived from the run: findable later
    assert (job.status, job.dialect, job.dag_run_id) == (JobStatus.QUEUED, "airflow", run_id)
    assert job.priority == settings.priority_weights["high"] and job.data_parallelism == 2
    assert job.resources == {"gpus": 1, "gpu_type": "nvidia-tesla-t4", "nodes_per_worker": 1}
    assert job.expires_at - job.created_at == timedelta(seconds=600)
    # A rerun of the same run, or a conf naming the job, finds it instead of making another.
    assert steps.register(store, settings, conf, run_id) == job_id
    assert steps.register(store, settings, {"job_id": job_id}, "manual__2") == job_id
    assert store.get_job(job_id).dag_run_id == "manual__2"


@pytest.mark.parametrize(
    ("conf", "reason"),
    [
        ({"model": "tiny-random-llama"}, "give exactly one of input_uri, input_file_ids, input_requests (got none)"),
        ({"input_uri": "/x.jsonl", "input_file_ids": ["f"]}, "(got input_uri, input_file_ids)"),
        ({"input_uri": "/x.jsonl", "model": "gpt-4o-mini"}, "unknown model 'gpt-4o-mini': known models are "),
        ({"input_uri": "/x.jsonl", "data_parallelism": 0}, "data_parallelism=0 is out of bounds"),
        ({"input_uri": "/x.jsonl", "max_runtime_sec": 0}, "max_runtime_sec=0 is out of bounds"),
        ({"input_uri": "/x.jsonl", "nodes_per_worker": 4}, "nodes_per_worker=4 needs the Kubernetes shard runner"),
        ({"input_uri": "/etc/passwd"}, "input_uri: /etc/passwd"),
        ({"input_requests": [{"body": {}}], "output_uri": "/root/out.json"}, "output_uri: /root/out.json"),
        ({"input_uri": "/x.jsonl", "model_config": {"engine_args": {"reasoning_parser_plugin": "/data/x/evil.py"}}},
         "reasoning_parser_plugin may not be set by a job"),
        ({"input_uri": "/x.jsonl", "model_config": {"max_model_len": -1}}, "model_config.max_model_len"),
        ({"input_uri": "/x.jsonl", "output_check": {"regex": "(unclosed"}}, "output_check: regex: does not compile"),
        ({"input_uri": "/x.jsonl", "output_check": {"regex": ".", "max_retries": 9}}, "output_check.max_retries: "),
        ({"input_uri": "/x.jsonl", "output_check": {"max_retries": 1}}, "output_check: give at least one of"),
        ({"input_uri": "/x.jsonl", "output_check": {"json_schema": {"$ref": "https://x/s.json"}}},
         "is not within the schema"),
    ],
)
def test_register_refuses_naming_the_problem_with_a_failed_job(store, settings, conf, reason):
    job_id = f"job_refused_{uuid.uuid4().hex[:8]}"
    with pytest.raises(jobs.JobRejected, match=re.escape(reason)):
        steps.register(store, settings, {"job_id": job_id, **conf}, _run_id())
    job = store.get_job(job_id)  # the reason, for the page, the API and the run's note
    assert job.status == jobs.JobStatus.FAILED and reason in job.status_reason
    assert job.input.uri is None and job.output_uri is None  # a refused path is not recorded


def test_a_runs_output_check_reaches_its_job_and_shards(store, settings):
    """The form's output_check is the job's (as the native create's is) and each shard's."""
    check = {"regex": "[A-Z].*", "max_retries": 1}
    job_id, tasks = _through_plan(store, settings, _conf(settings, output_check=check))
    assert store.get_job(job_id).input.output_check.model_dump(exclude_defaults=True) == check
    assert {orjson.loads(t["options_json"])["output_check"]["regex"] for t in tasks} == {"[A-Z].*"}


def test_multi_node_workers_register_with_the_kubernetes_runner(store, settings):
    """Only the local runner refuses nodes_per_worker > 1 (it names what to use instead);
    with the Kubernetes runner the job is made and its shards carry the node count."""
    with pytest.raises(jobs.JobRejected, match="use gpus for a bigger worker or data_parallelism"):
        steps.register(store, settings, _conf(settings, nodes_per_worker=2), _run_id())
    kubernetes = settings.model_copy(update={"shard_runner": "kubernetes"})
    job_id, tasks = _through_plan(store, kubernetes, _conf(kubernetes, nodes_per_worker=2, gpus=4))
    assert store.get_job(job_id).resources == {"gpus": 4, "gpu_type": None, "nodes_per_worker": 2}
    assert [(t["nodes_per_worker"], t["gpus"]) for t in tasks] == [(2, 4)]


def test_a_run_of_another_owner_cannot_take_over_a_job(store, settings):
    """A user who may trigger runs names someone else's job_id: refused, and that job's
    record, run and status stay as they were, even when the foreign run then fails."""
    job_id = steps.register(store, settings, {**_conf(settings), "owner": "alice"}, _run_id(), trusted=True)
    before = store.get_job(job_id)
    with pytest.raises(jobs.JobRejected, match="belongs to another run"):
        steps.register(store, settings, {"job_id": job_id, "owner": "mallory"}, "manual__mallory")
    steps.fail_job(store, job_id, "the foreign run failed", dag_run_id="manual__mallory")
    after = store.get_job(job_id)
    assert (after.status, after.dag_run_id, after.owner) == (before.status, before.dag_run_id, "alice")
    # A scheduled (trusted) run and the owner's own runs still may.
    assert steps.register(store, settings, {"job_id": job_id, "owner": "alice"}, "manual__alice") == job_id


def test_register_holds_a_users_paths_to_their_namespace(store, settings):
    root = settings.local_roots[0]
    other = root / "bob" / "in.jsonl"
    other.parent.mkdir(parents=True, exist_ok=True)
    other.write_bytes(_chat(0) + b"\n")
    with pytest.raises(jobs.JobRejected, match="outside your storage namespace"):
        steps.register(store, settings, {"input_uri": str(other), "owner": "alice"}, _run_id())
    for internal in (f"{settings.database_url.removeprefix('sqlite:///')}-wal", str(settings.home / "api-key")):
        with pytest.raises(jobs.JobRejected):
            steps.register(store, settings, {"input_requests": [{"body": {}}], "output_uri": internal}, _run_id(), trusted=True)
    # A schedule (an admin's spec) may read any user folder; relative paths are the owner's.
    job = store.get_job(steps.register(store, settings, {"input_uri": str(other)}, _run_id(), trusted=True))
    assert job.input == JobInput(uri=str(other))
    job = store.get_job(steps.register(store, settings, {"input_uri": "in.jsonl", "owner": "bob"}, _run_id()))
    assert job.input == JobInput(uri=str(other))


def test_validate_counts_bad_lines(store, settings):
    job_id = steps.register(store, settings, _conf(settings, n=6, bad=(1, 4)), _run_id())
    counts = steps.validate(store, settings, job_id)
    job = store.get_job(job_id)
    assert counts == {"total": 6, "valid": 4, "invalid": 2}
    assert (job.status, job.total, job.failed, job.completed) == (JobStatus.VALIDATING, 6, 2, 2)


def test_validate_rejects_a_batch_without_valid_lines_and_serves_its_errors(store, settings):
    job_id = steps.register(store, settings, _conf(settings, n=3, bad=(0, 1, 2)), _run_id())
    with pytest.raises(jobs.JobRejected, match="input rejected"):
        steps.validate(store, settings, job_id)
    job = store.get_job(job_id)
    assert job.status == JobStatus.FAILED and "input rejected" in job.status_reason
    assert (job.total, job.failed) == (3, 3)
    error_file = store.get_file(job.error_file_id)
    assert len(storage.read_bytes(error_file.uri).splitlines()) == 3


def test_validate_names_a_missing_input_file(store, settings):
    """A file deleted between the run's register and its validation."""
    file = store.create_file(owner="airflow", purpose="batch", filename="in.jsonl", bytes=1, uri="/x/in.jsonl")
    job_id = steps.register(store, settings, {"input_file_ids": [file.id], "model": "tiny-random-llama"}, _run_id())
    store.mark_file_deleted(file.id)
    with pytest.raises(jobs.JobRejected, match=file.id):
        steps.validate(store, settings, job_id)
    assert store.get_job(job_id).status == JobStatus.FAILED


def test_a_runs_input_files_are_its_users_own_batch_inputs(store, settings):
    """A run from Airflow's UI or /api/v2 names input_file_ids: they must be its triggering
    user's (anyone's for an admin's or a schedule's run) and uploaded with purpose batch;
    someone else's file is refused exactly like a missing one, and no job is made."""
    def upload(owner: str, purpose: str = "batch") -> str:
        return store.create_file(owner=owner, purpose=purpose, filename="f", bytes=1, uri=f"/x/{uuid.uuid4().hex}").id

    alices, bobs, media = upload("alice"), upload("bob"), upload("alice", "ocr")
    conf = {"model": "tiny-random-llama", "owner": "alice"}
    answers = []
    for n, file_id in enumerate((bobs, "file-missing")):
        with pytest.raises(jobs.JobRejected) as refused:
            steps.register(store, settings, {**conf, "job_id": f"job_refused_{n}", "input_file_ids": [alices, file_id]}, _run_id())
        answers.append(str(refused.value).replace(file_id, "<id>"))
    assert answers[0] == answers[1] == "input_file_ids[1]: No file found with id '<id>'."
    with pytest.raises(jobs.JobRejected, match=f"input_file_ids\\[0\\]: file '{media}' was uploaded with purpose 'ocr'"):
        steps.register(store, settings, {**conf, "job_id": "job_refused_2", "input_file_ids": [media]}, _run_id())
    # Each refusal is a FAILED job naming why, with no input (bob's file id is not recorded);
    # the same job id again (a cleared run) is refused the same way.
    refused_job = store.get_job("job_refused_0")
    assert refused_job.status == jobs.JobStatus.FAILED and refused_job.input == JobInput()
    with pytest.raises(jobs.JobRejected, match="No file found with id"):
        steps.register(store, settings, {**conf, "job_id": "job_refused_0", "input_file_ids": [alices]}, _run_id())
    assert store.get_job(steps.register(store, settings, {**conf, "input_file_ids": [alices]}, _run_id())).owner == "alice"
    trusted = steps.register(store, settings, {**conf, "input_file_ids": [bobs]}, _run_id(), trusted=True)
    assert store.get_job(trusted).input == JobInput(file_ids=[bobs])


def test_a_run_whose_user_has_no_owner_name_makes_no_job(store, settings):
    with pytest.raises(jobs.JobRejected, match="'Alice' is not an owner name"):
        steps.register(store, settings, {"input_requests": [{"body": {}}], "owner": "Alice", "job_id": "job_x"}, _run_id())
    assert store.get_job("job_x") is None


def _admins(auth_manager: str, names: tuple[str, ...]) -> subprocess.Popen:
    """is_admin of each name in a process whose Airflow configuration (its environment) has
    ``auth_manager`` and the simple auth manager's users; prints a JSON list."""
    env = {**os.environ, "AIRFLOW__CORE__AUTH_MANAGER": auth_manager,
           "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS": "alice:user,root:admin,vic:viewer"}
    code = "import json, sys; from llm_batch.airflow.users import is_admin; print(json.dumps([is_admin(n) for n in sys.argv[1:]]))"
    return subprocess.Popen([sys.executable, "-c", code, *names], env=env, stdout=subprocess.PIPE, text=True)


def _last_line(process: subprocess.Popen):
    out = process.communicate(timeout=120)[0]
    assert process.returncode == 0, out
    return json.loads(out.splitlines()[-1])  # after whatever Airflow prints on import


def test_an_airflow_admin_is_told_from_the_simple_auth_managers_users():
    simple = _admins("airflow.api_fastapi.auth.managers.simple.simple_auth_manager.SimpleAuthManager",
                     ("root", "alice", "vic", "nobody"))
    fab = _admins("airflow.providers.fab.auth_manager.fab_auth_manager.FabAuthManager", ("root",))
    assert _last_line(simple) == [True, False, False, False]
    assert _last_line(fab) == [False]  # roles out of a task's reach: no admin


def test_inline_requests_are_validated(store, settings):
    requests = [{"custom_id": "a", "body": {"messages": [{"role": "user", "content": "hi"}]}}, {"body": {}}]
    job_id = steps.register(store, settings, {"input_requests": requests, "model": "tiny-random-llama"}, _run_id())
    assert steps.validate(store, settings, job_id) == {"total": 2, "valid": 1, "invalid": 1}


# -- plan, shards, merge, finalize ---------------------------------------------------------


def test_plan_gives_each_shard_the_jobs_priority(store, settings):
    job_id = steps.register(store, settings, _conf(settings, n=5, data_parallelism=2, priority="low"), _run_id())
    steps.validate(store, settings, job_id)
    planned = steps.plan(store, settings, job_id)
    tasks = [shard_task.ShardTask.model_validate(t.model_dump()) for t in planned]
    assert [t.shard for t in tasks] == [0, 1]
    assert {t.priority for t in tasks} == {"low"}
    job = store.get_job(job_id)
    assert job.status == JobStatus.RUNNING
    args = tasks[0].worker_args()
    assert args[0] == "worker" and args[args.index("--job-id") + 1] == job_id
    assert float(args[args.index("--deadline") + 1]) == pytest.approx(job.expires_at.timestamp())
    assert orjson.loads(args[args.index("--model-config") + 1])["model"] == "tiny-random-llama"
    options = JobOptions.model_validate_json(args[args.index("--options") + 1])
    assert options.moderation_shape == "scores"  # a run's conf: the native route's shape
    from llm_batch.core.owners import cache_salt  # the owner's prefix-cache namespace, the server's

    assert args[args.index("--cache-salt") + 1] == cache_salt(job.owner) != cache_salt("someone-else")
    # A retried plan task plans the same shards again.
    assert steps.plan(store, settings, job_id) == planned


def test_a_shards_xcom_carries_ids_and_counts_and_its_task_comes_from_the_store(store, settings):
    """Every Airflow viewer reads a run's XComs: prepare pushes shard refs, never the work
    paths, model config or output check, and each shard task finds its own again."""
    conf = _conf(settings, n=5, data_parallelism=2, output_check={"regex": "^secret-shape$"})
    job_id = steps.register(store, settings, conf, _run_id())
    steps.validate(store, settings, job_id)
    planned = steps.plan(store, settings, job_id)
    refs = [steps.shard_ref(task) for task in planned]
    assert refs == [{"job_id": job_id, "shard": t.shard, "requests": t.requests} for t in planned]
    assert sum(ref["requests"] for ref in refs) == 5
    assert "secret-shape" not in str(refs) and settings.work_uri not in str(refs)
    assert [steps.shard_task(ref, settings, store) for ref in refs] == planned
    assert steps.shard_task(planned[0].model_dump(), settings) == planned[0]  # a whole task, as it is


def test_whole_run_succeeds_with_outputs_and_counts(store, settings):
    job_id, tasks = _through_plan(store, settings, _conf(settings, n=7, bad=(2,), data_parallelism=3))
    for task in tasks:
        _run_worker(task)
        live = shard_task.report_shard(store, shard_task.ShardTask.model_validate(task))
    assert (live.completed, live.succeeded, live.failed) == (7, 6, 1)  # the invalid line included
    assert (live.prompt_tokens, live.completion_tokens, live.cached_prompt_tokens, live.engine_seconds) == (30, 12, 6, 4.5)

    counts = steps.merge(store, settings, job_id)
    job = steps.finalize(store, settings, job_id)

    assert counts == {"total": 7, "succeeded": 6, "failed": 1, "not_run": 0, "invalid": 1, "prompt_tokens": 30,
                      "completion_tokens": 12, "cached_prompt_tokens": 6, "reasoning_tokens": 0,
                      "result_cache_hits": 0, "result_cache_tokens": 0,
                      "invalid_output": 0, "output_retries": 0, "retry_tokens": 0, "by_model": {}}
    assert (job.prompt_tokens, job.completion_tokens, job.cached_prompt_tokens, job.reasoning_tokens) == (30, 12, 6, 0)
    assert job.status == JobStatus.SUCCEEDED and job.completed_at is not None
    assert (job.total, job.succeeded, job.failed, job.completed) == (7, 6, 1, 7)
    # Ended, the job keeps the rate its engines ran at: their tokens over their engine seconds.
    assert job.tokens_per_s == round(12 / 4.5, 1)
    output = [orjson.loads(line) for line in storage.read_bytes(store.get_file(job.output_file_id).uri).splitlines()]
    assert [r["custom_id"] for r in output] == [f"req-{i}" for i in range(7) if i != 2]
    assert job.errors == [{"code": "invalid_request", "message": "input lines failed validation", "count": 1}]
    # Idempotent: finalize again changes nothing; merge of a finished job does nothing.
    assert steps.finalize(store, settings, job_id) == store.get_job(job_id)
    assert steps.merge(store, settings, job_id) is None


@pytest.mark.parametrize(
    ("stop", "status", "reason", "code"),
    [
        ("cancel", JobStatus.CANCELLED, "the job was cancelled; 3 requests were not run", "batch_cancelled"),
        ("deadline", JobStatus.TIMEOUT_EXCEEDED, "the job's deadline passed; 3 requests were not run", "batch_expired"),
        (None, JobStatus.FAILED, "a shard failed after its retries; 3 requests were not run", "shard_failed"),
    ],
)
def test_partial_results_end_by_cause(store, settings, stop, status, reason, code):
    conf = _conf(settings, n=5, max_runtime_sec=1 if stop == "deadline" else 3600)
    job_id, [task] = _through_plan(store, settings, conf)
    _run_worker(task, finish=2)
    if stop == "cancel":
        store.request_cancel(job_id)
        assert shard_task.mirror_cancel(store, job_id, task["cancel_marker"])
        assert storage.exists(task["cancel_marker"])
    elif stop == "deadline":
        store._update_job(job_id, expires_at=utcnow() - timedelta(seconds=1))

    counts = steps.merge(store, settings, job_id)
    job = steps.finalize(store, settings, job_id)

    assert counts["not_run"] == 3
    assert (job.status, job.status_reason) == (status, reason)
    # Never-run requests have an outcome: failed, and completed (succeeded + failed).
    assert (job.total, job.completed, job.succeeded, job.failed) == (5, 5, 2, 3)
    errors = [orjson.loads(line) for line in storage.read_bytes(store.get_file(job.error_file_id).uri).splitlines()]
    assert [e["error"]["code"] for e in errors] == [code] * 3


def test_cancel_after_validation_before_plan_accounts_for_every_line(store, settings):
    """Was: failed = the invalid lines, no error file, the valid lines nowhere."""
    job_id = steps.register(store, settings, _conf(settings, n=6, bad=(2,)), _run_id())
    steps.validate(store, settings, job_id)
    store.request_cancel(job_id)
    assert steps.plan(store, settings, job_id) == []
    counts = steps.merge(store, settings, job_id)
    job = steps.finalize(store, settings, job_id)
    assert job.status == JobStatus.CANCELLED
    assert (counts["not_run"], counts["invalid"]) == (5, 1)
    assert (job.total, job.completed, job.succeeded, job.failed) == (6, 6, 0, 6)
    errors = [orjson.loads(line) for line in storage.read_bytes(store.get_file(job.error_file_id).uri).splitlines()]
    assert [e["line"] for e in errors] == [1, 2, 3, 4, 5, 6]
    assert sorted(e["error"]["code"] for e in errors).count("batch_cancelled") == 5


def test_cancel_before_the_input_is_read_says_so(store, settings):
    job_id = steps.register(store, settings, _conf(settings), _run_id())
    store.request_cancel(job_id)
    assert steps.validate(store, settings, job_id) is None
    assert steps.plan(store, settings, job_id) == []
    assert steps.merge(store, settings, job_id) is None
    job = steps.finalize(store, settings, job_id)
    assert job.status == JobStatus.CANCELLED and "before its input was read" in job.status_reason
    assert (job.total, job.completed, job.failed) == (0, 0, 0)


def test_run_that_ended_before_merge_fails_the_job(store, settings):
    job_id, _ = _through_plan(store, settings, _conf(settings))
    job = steps.finalize(store, settings, job_id)
    assert job.status == JobStatus.FAILED and "before the shards' results were merged" in job.status_reason


@pytest.mark.parametrize(
    ("code", "state"),
    [(exit_codes.DONE, "done"), (exit_codes.CANCELLED, "cancelled"), (exit_codes.DEADLINE, "deadline"),
     (exit_codes.USAGE, "usage"), (exit_codes.FAILED, "failed"), (-9, "failed")],
)
def test_interpret_exit(code, state):
    outcome = shard_task.interpret_exit(4, code)
    assert (outcome.shard, outcome.exit_code, outcome.state) == (4, code, state)


# -- housekeeping --------------------------------------------------------------------------


def test_expire_ends_live_jobs_past_expires_at(store, settings):
    old = store.create_job(dialect="openai", endpoint="/v1/chat/completions", model="m", owner="o",
                           created_at=utcnow() - timedelta(hours=2), max_runtime_sec=60)
    fresh = store.create_job(dialect="openai", endpoint="/v1/chat/completions", model="m", owner="o", max_runtime_sec=3600)
    assert housekeeping.expire(store, settings) == [old.id]
    assert store.get_job(old.id).status == JobStatus.TIMEOUT_EXCEEDED
    assert store.get_job(fresh.id).status == JobStatus.QUEUED


def test_expire_keeps_what_finished(store, settings):
    job_id, [task] = _through_plan(store, settings, _conf(settings, n=4, max_runtime_sec=60))
    _run_worker(task, finish=1)
    store._update_job(job_id, expires_at=utcnow() - timedelta(hours=1))

    assert housekeeping.expire(store, settings) == [job_id]

    job = store.get_job(job_id)
    assert (job.status, job.succeeded, job.failed) == (JobStatus.TIMEOUT_EXCEEDED, 1, 3)
    assert job.status_reason == "the job's deadline passed; 3 requests were not run"
    assert store.get_file(job.output_file_id) is not None


def test_reconcile_finishes_jobs_whose_run_ended(store, settings):
    ended, live = _run_id(), _run_id()
    done_id, tasks = _through_plan(store, settings, _conf(settings, n=3), run_id=ended)
    for task in tasks:
        _run_worker(task)
    running_id, _ = _through_plan(store, settings, _conf(settings, n=3), run_id=live)

    reconciled = housekeeping.reconcile(store, settings, {ended: "failed", live: "running"})

    assert reconciled == [done_id]
    assert store.get_job(done_id).status == JobStatus.SUCCEEDED  # every request had its result
    assert store.get_job(running_id).status == JobStatus.RUNNING


def test_retention_deletes_old_files_and_marks_them(store, settings):
    job_id, tasks = _through_plan(store, settings, _conf(settings, n=2))
    for task in tasks:
        _run_worker(task)
    steps.merge(store, settings, job_id)
    job = steps.finalize(store, settings, job_id)
    output = store.get_file(job.output_file_id)

    assert housekeeping.delete_expired_files(store, settings) == []  # young files stay
    later = utcnow() + timedelta(days=settings.retention_days + 1)
    deleted = housekeeping.delete_expired_files(store, settings, now=later)

    assert set(deleted) == {job.output_file_id, job.error_file_id}
    assert store.get_file(output.id) is None and store.get_file(output.id, include_deleted=True).deleted
    assert not storage.exists(output.uri)


def test_a_watcher_reads_only_its_own_shards_progress(store, settings, monkeypatch):
    """O(shards), not O(shards^2): one shard's report is one storage read, of its own
    progress object, however many shards the job has; the job's counts come from the rows."""
    job_id, tasks = _through_plan(store, settings, _conf(settings, n=8, bad=(0,), data_parallelism=4))
    for task in tasks:
        _run_worker(task)
    reads: list[str] = []
    for name in ("open_read", "exists", "size", "list_uris"):
        real = getattr(storage, name)
        monkeypatch.setattr(storage, name, lambda uri, _real=real, **kwargs: (reads.append(uri), _real(uri, **kwargs))[1])
    shards = [shard_task.ShardTask.model_validate(t) for t in tasks]
    for shard in shards:
        reads.clear()
        job = shard_task.report_shard(store, shard)
        assert reads == [shard.progress_uri]
    assert (job.completed, job.succeeded, job.failed) == (8, 7, 1)
    assert [r.shard for r in store.shard_records(job_id)] == [0, 1, 2, 3]


def test_a_failed_shards_outcome_reaches_merge_and_the_reason(store, settings):
    """The shard task's outcome lands in its row; the requests it never ran say which shard
    and why, and so does the job's reason."""
    job_id, tasks = _through_plan(store, settings, _conf(settings, n=6, data_parallelism=2))
    done, failed = (shard_task.ShardTask.model_validate(t) for t in tasks)
    _run_worker(tasks[0])
    _run_worker(tasks[1], finish=1)
    shard_task.report_shard(store, done, shard_task.interpret_exit(0, 0))
    outcome = shard_task.ShardOutcome(shard=1, exit_code=1, state="failed", message="the worker failed (exit status 1) on attempt 3 of 3")
    shard_task.report_shard(store, failed, outcome)
    steps.merge(store, settings, job_id)
    job = steps.finalize(store, settings, job_id)
    assert job.status == JobStatus.FAILED
    assert job.status_reason == "shard 1: the worker failed (exit status 1) on attempt 3 of 3; 2 requests were not run"
    errors = [orjson.loads(x) for x in storage.read_bytes(store.get_file(job.error_file_id).uri).splitlines()]
    assert [(e["error"]["code"], e["error"]["message"]) for e in errors] == [
        ("shard_failed", "shard 1: the worker failed (exit status 1) on attempt 3 of 3")] * 2


def test_a_store_down_for_a_moment_does_not_stop_a_shard(store, settings, monkeypatch):
    """The runners ask shard_stop_cause every few seconds while a worker runs: a store
    restart (a failing read) is asked again next round, the deadline still applies."""
    from sqlalchemy.exc import OperationalError

    conf = _conf(settings, n=2)
    job_id, [task] = _through_plan(store, settings, conf)

    def down(*args, **kwargs):
        raise OperationalError("SELECT", {}, Exception("server closed the connection unexpectedly"))

    monkeypatch.setattr(store, "get_job", down)
    deadline = utcnow() + timedelta(hours=1)
    assert shard_task.shard_stop_cause(store, job_id, task["cancel_marker"], deadline) is None
    assert shard_task.shard_stop_cause(store, job_id, task["cancel_marker"], utcnow() - timedelta(seconds=1)) == "deadline"


@pytest.mark.parametrize("unique", [True, False])
def test_a_custom_id_twice_refuses_the_batch_when_the_job_says_so(store, settings, unique):
    # OpenAI's batches (the dialect's create sets unique_custom_ids): the whole batch fails at
    # validation naming the duplicate and no line runs; otherwise the later line is an error.
    lines = [_chat(0), _chat(1), _chat(0), _chat(2)]
    job = store.create_job(dialect="openai", endpoint="/v1/chat/completions", model="tiny-random-llama",
                           owner=run_conf.DEFAULT_OWNER,
                           input=JobInput(uri=_input(settings, lines), unique_custom_ids=unique).stored())
    if unique:
        with pytest.raises(jobs.JobRejected, match=r"line 3: .*req-0"):
            steps.validate(store, settings, job.id)
        failed = store.get_job(job.id)
        assert failed.status == jobs.JobStatus.FAILED and "req-0" in failed.status_reason
        assert not storage.exists(steps.layout_of(settings, job.id).validated)  # nothing to run
    else:
        assert steps.validate(store, settings, job.id) == {"total": 4, "valid": 3, "invalid": 1}


def test_a_cancel_while_the_input_is_read_stops_the_read_and_ends_the_job(store, settings):
    """Was: a big input was read through (minutes) before the cancel was seen."""
    job_id = steps.register(store, settings, _conf(settings, n=3 * STOP_CHECK_ITEMS), _run_id())

    class CancelledOnceReading:
        """The job store, where the cancel arrives once validation has begun."""

        reads = 0

        def __getattr__(self, name):
            return getattr(store, name)

        def get_job(self, job_id):
            self.reads += 1
            if self.reads == 2:  # the first read after validate's own check
                store.request_cancel(job_id)
            return store.get_job(job_id)

    assert steps.validate(CancelledOnceReading(), settings, job_id) is None
    layout = steps.layout_of(settings, job_id)
    assert not storage.exists(layout.validation_report) and not storage.exists(layout.validated)  # nothing published
    assert steps.plan(store, settings, job_id) == []
    job = steps.finalize(store, settings, job_id)
    assert job.status == JobStatus.CANCELLED and "before its input was read" in job.status_reason


def test_a_run_is_its_triggering_users_or_the_owner_its_spec_names():
    """A recurring spec's `owner` makes its runs that owner's jobs, held to that owner's paths;
    a spec naming none stays the admin's; a user's own trigger is always theirs."""
    from llm_batch.core.run_conf import DEFAULT_OWNER
    from llm_batch.pipeline.recurring import RecurringSpec

    admins = {"root"}.__contains__
    spec = RecurringSpec(name="n", schedule="@daily", input_uri="in.jsonl", model="m", owner="alice")
    assert spec.run_conf()["owner"] == "alice"
    assert steps.run_owner(None, spec.run_conf(), admins) == ("alice", False)
    assert steps.run_owner(None, {"model": "m"}, admins) == (DEFAULT_OWNER, True)
    assert steps.run_owner("bob", spec.run_conf(), admins) == ("bob", False)  # a conf never overrides its user
    assert steps.run_owner("root", {}, admins) == ("root", True)
    with pytest.raises(ValueError, match="owner"):
        RecurringSpec(name="n", schedule="@daily", input_uri="in.jsonl", model="m", owner="Alice/../bob")


def test_a_spec_owners_run_names_only_that_owners_paths(store, settings):
    conf = _conf(settings)  # a file in the admin's folder
    owner, trusted = steps.run_owner(None, {**conf, "owner": "alice"}, lambda _: False)
    with pytest.raises(jobs.JobRejected, match="input_uri"):
        steps.register(store, settings, {**conf, "owner": owner}, _run_id(), trusted=trusted)
    owner, trusted = steps.run_owner(None, conf, lambda _: False)  # the admin's spec may
    assert store.get_job(steps.register(store, settings, {**conf, "owner": owner}, _run_id(), trusted=trusted)).owner == owner


def test_a_run_is_admitted_as_the_api_admits_a_create(store, settings):
    """The form and /api/v2 pass the API's own admission (llm_batch.pipeline.admission), so a
    run is refused what a create is refused, in the same words with the conf's field named:
    an input that is not there, an output another owner's job wrote, a model that cannot
    serve the endpoint; and an owner's own adapter is a model its runs may name."""
    from llm_batch.pipeline import admission

    owner = run_conf.DEFAULT_OWNER
    missing = str(settings.local_roots[0] / "alice" / "never-written.jsonl")
    cases = {
        "input_uri": {"input_uri": missing, "model": "tiny-random-llama"},
        "model": {**_conf(settings), "endpoint": "/v1/embeddings"},
    }
    reasons = {}
    for param, conf in cases.items():
        with pytest.raises(jobs.JobRejected) as refused:
            steps.register(store, settings, {**conf, "owner": "alice"}, _run_id())
        reasons[param] = str(refused.value)
        assert reasons[param].startswith(param), refused.value
    with pytest.raises(jobs.Refused) as api_refusal:  # what the native route answers (400)
        admission.check_input_readable(missing, missing, "input_uri", settings, admission.Owner("alice"))
    assert (api_refusal.value.code, api_refusal.value.message) == ("path_unavailable", reasons["input_uri"])

    # An output file another owner's job wrote: refused, as the API refuses it (409).
    theirs = settings.local_roots[0] / "bob" / f"out-{uuid.uuid4().hex[:6]}.json"
    theirs.parent.mkdir(parents=True, exist_ok=True)
    bob_job = steps.register(store, settings, {**_conf(settings), "output_uri": str(theirs), "owner": "bob"},
                             _run_id(), trusted=True)
    theirs.write_text("[]")
    assert store.get_job(bob_job).array_output_uri == str(theirs)
    with pytest.raises(jobs.JobRejected, match="output_uri: .* is the output of a job not yet ended"):
        steps.register(store, settings, {**_conf(settings), "output_uri": str(theirs)}, _run_id(), trusted=True)
    store.end_job(bob_job, jobs.JobStatus.FAILED, "ended for the test")
    with pytest.raises(jobs.JobRejected, match="output_uri: .* no job of yours wrote it"):
        steps.register(store, settings, {**_conf(settings), "output_uri": str(theirs)}, _run_id(), trusted=True)

    # An output that is the input: refused, as the native route refuses it.
    conf = _conf(settings)
    with pytest.raises(jobs.JobRejected, match="output_uri is the input_uri"):
        steps.register(store, settings, {**conf, "output_uri": conf["input_uri"]}, _run_id(), trusted=True)

    # An owner's own adapter is a model the owner's run may name; another owner's is unknown.
    store.create_adapter(owner="alice", name="alice-lora", base="tiny-random-llama", uri="/x/", rank=8, bytes=1)
    alices = _input(settings, [_chat(0)]).replace(f"/{owner}/", "/alice/")
    Path(alices).parent.mkdir(parents=True, exist_ok=True)
    Path(alices).write_bytes(_chat(0) + b"\n")
    made = steps.register(store, settings, {"input_uri": alices, "model": "alice-lora", "owner": "alice"}, _run_id())
    assert store.get_job(made).model == "alice-lora"
    with pytest.raises(jobs.JobRejected, match="unknown model 'alice-lora'"):
        steps.register(store, settings, {**_conf(settings), "model": "alice-lora", "owner": "bob"}, _run_id())
