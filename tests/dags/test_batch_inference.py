"""batch_inference end to end with dag.test(): local runner, real worker, tiny real model.

Each run starts vLLM once per shard (~12 s idle machine, over a minute under load), so the
runs are few and small. Outcomes are checked through the job store and the merged files,
never through generated text.
"""

from __future__ import annotations

import copy
import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson
import pytest

from llm_batch.core.config import Settings, get_settings
from llm_batch.core.jobs import JobStatus
from llm_batch.core.layout import JobLayout
from llm_batch.core.run_conf import SHARD_TASK_ID
from llm_batch.infra import storage
from llm_batch.infra.progress import read_progress
from llm_batch.infra.results import count_results

pytestmark = [pytest.mark.airflow]

TINY_MODEL = "tiny-random-llama"


def _request(i: int, max_tokens: int = 8, **sampling: Any) -> bytes:
    body = {"model": TINY_MODEL, "messages": [{"role": "user", "content": f"count to {i}"}],
            "max_tokens": max_tokens, **sampling}
    return orjson.dumps({"custom_id": f"req-{i}", "body": body})


# dag.test() triggers its runs as this user: their paths live in its folder of the user root.
DAG_TEST_USER = "dag_test"


def _write_input(home: Path, name: str, lines: list[bytes]) -> str:
    path = home / "data" / DAG_TEST_USER / f"{name}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"\n".join(lines) + b"\n")
    return str(path)


def _lines(uri: str) -> list[dict[str, Any]]:
    return [orjson.loads(line) for line in storage.read_bytes(uri).splitlines() if line.strip()]


def _run(dag, conf: dict[str, Any], during: Callable[[], None] | None = None):
    """dag.test(conf), with `during` running in a thread meanwhile (cancel, kill...)."""
    errors: list[BaseException] = []

    def guarded() -> None:
        try:
            during()
        except BaseException as exc:  # noqa: BLE001 - re-raised in the test thread
            errors.append(exc)

    helper = threading.Thread(target=guarded, daemon=True) if during else None
    if helper:
        helper.start()
    dag_run = dag.test(run_conf=conf)
    if helper:
        helper.join(timeout=60)
    assert not errors, errors
    return dag_run


def with_shard_settings(dag, settings: Settings):
    """A copy of ``dag`` whose shard tasks run with ``settings`` (each shard operator's
    ``llm_settings``); its other tasks keep those the DAG file was parsed with."""
    copied = copy.deepcopy(dag)
    shards = copied.get_task(SHARD_TASK_ID)
    base = shards.operator_class
    shards.operator_class = type(base.__name__, (base,), {"__module__": base.__module__, "llm_settings": settings})
    return copied


def _wait_for(condition: Callable[[], bool], timeout: float, what: str, poll: float = 0.5) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if condition():
            return
        time.sleep(poll)
    raise AssertionError(f"timed out waiting for {what}")


# How often a kill test looks for its shard's checkpoint: the kill follows within this, and
# what the shard has left after its first part takes thousands of engine steps (seconds).
KILL_POLL_S = 0.02


def hold_shards(layout: JobLayout, after_results: int) -> None:
    """Each shard's first attempt holds once ``after_results`` of its results are checkpointed,
    until the marker goes (the worker's hold point): written before the run, so a kill, a
    cancel or a deadline lands mid-shard by construction."""
    storage.write_bytes(layout.hold_marker, orjson.dumps({"after_results": after_results}))


def _progress_done(uri: str) -> int:
    try:
        return read_progress(uri).done
    except (storage.StorageError, ValueError):
        return 0


def _assert_every_request_once(layout: JobLayout, job, n_lines: int) -> tuple[list, list]:
    outputs, errors = _lines(layout.output_jsonl), _lines(layout.errors_jsonl)
    ids = [r["custom_id"] for r in outputs] + [r["custom_id"] for r in errors if r["custom_id"]]
    assert len(outputs) + len(errors) == n_lines == job.total
    assert len(ids) == len(set(ids)), "a request appears twice"
    assert job.succeeded == len(outputs) and job.failed == len(errors)
    assert job.total == job.succeeded + job.failed == job.completed  # every request has an outcome
    return outputs, errors


def test_bad_conf_is_refused(batch_dag):
    from airflow.sdk.exceptions import ParamValidationError

    for conf in ({"data_parallelism": 0}, {"data_parallelism": 65}, {"endpoint": "/v1/conversations"},
                 {"max_runtime_sec": 604801}, {"max_runtime_sec": 0}, {"model": "gpt-4o-mini"}):
        with pytest.raises(ParamValidationError):
            batch_dag.test(run_conf={"input_uri": "/nowhere.jsonl", **conf})


def test_unsupported_resources_fail_the_run_with_the_reason(batch_dag, store):
    dag_run = batch_dag.test(run_conf={"job_id": "job_multinode", "input_uri": "/x.jsonl", "nodes_per_worker": 2})
    assert dag_run.state == "failed"
    assert "nodes_per_worker=2" in _refused(dag_run)
    _assert_refused_job(store, "job_multinode", dag_run, "nodes_per_worker=2")


def _assert_refused_job(store, job_id: str, dag_run, reason: str) -> None:
    """A refused run leaves a FAILED job with the reason (seen on the page and in the API),
    no input recorded, and (the run-end listener's) a one-line note saying why."""
    from llm_batch.api.listeners import run_note

    job = store.get_job(job_id)
    assert job is not None and job.status.value == "FAILED", job
    assert job.status_reason.startswith("the run was refused: ") and reason in job.status_reason, job.status_reason
    assert job.dag_run_id == dag_run.run_id and job.input.uri is None and not job.input.file_ids
    note = run_note(job)
    assert "FAILED" in note and "the run was refused" in note, note
    assert _note_after_run_end(dag_run) == note


def _note_after_run_end(dag_run) -> str | None:
    """The run's note as the plugin's run-end listener writes it (dag.test runs without the
    plugin: the listener is called here, in a session as the scheduler's)."""
    from airflow.models.dagrun import DagRun
    from airflow.utils.session import create_session

    from llm_batch.api import listeners

    with create_session() as session:
        listeners._on_run_end(session.get(DagRun, dag_run.id), "failed", None)
    with create_session() as session:
        return session.get(DagRun, dag_run.id).note


def _refused(dag_run) -> str:
    """Why prepare refused the run (its XCom, which finalize repeats)."""
    from airflow.models.xcom import XComModel
    from airflow.utils.session import create_session

    with create_session() as session:
        row = session.scalars(XComModel.get_many(run_id=dag_run.run_id, key="refused", task_ids="prepare")).first()
        return XComModel.deserialize_value(row) if row is not None else ""


def _states(dag_run) -> dict[str, str]:
    return {ti.task_id: ti.state for ti in dag_run.get_task_instances() if ti.map_index < 0}


@pytest.mark.parametrize(("conf", "reason"), [
    # Kubernetes-only fields stay accepted in a conf (API runs), and are checked at prepare.
    ({"gpu_type": "nvidia-tesla-v100"}, "gpu_type 'nvidia-tesla-v100' is unknown"),
    ({"gpus": 0}, "gpus=0 is out of bounds"),
    ({"input_requests": [{"body": {}}]}, "give exactly one of input_uri, input_file_ids, input_requests"),
])
def test_bad_conf_beyond_the_form_is_one_red_task(batch_dag, store, conf, reason):
    job_id = f"job_bad_{abs(hash(reason)) % 10**8}"
    dag_run = batch_dag.test(run_conf={"job_id": job_id, "input_uri": "/x.jsonl", **conf})
    assert dag_run.state == "failed"
    assert reason in _refused(dag_run)
    _assert_refused_job(store, job_id, dag_run, reason)  # one mistake: a FAILED job saying why
    states = _states(dag_run)
    # One mistake: prepare fails (no retry), the shards never start, finalize fails once with
    # the reason (a run's state is its last task's) instead of three times on "job None".
    assert states["prepare"] == "failed"
    assert states["run_shard"] == "upstream_failed" and states["finalize"] == "failed", states
    tries = {ti.task_id: ti.try_number for ti in dag_run.get_task_instances() if ti.map_index < 0}
    assert tries["prepare"] == tries["finalize"] == 1, tries


def test_unknown_model_is_refused_at_register_naming_the_known_ones(store):
    from llm_batch.pipeline import steps

    with pytest.raises(steps.JobRejected) as refused:
        steps.register(store, get_settings(), {"job_id": "job_unknown_model", "input_uri": "/x.jsonl",
                                               "model": "gpt-4o-mini"}, "run_unknown_model", trusted=True)
    assert str(refused.value).startswith("model: unknown model 'gpt-4o-mini': known models are ")
    assert "tiny-random-llama" in str(refused.value)
    job = store.get_job("job_unknown_model")
    assert job is not None and job.status.value == "FAILED" and "gpt-4o-mini" in job.status_reason


def test_a_form_run_naming_a_path_it_may_not_use_fails_with_a_job_and_a_note(batch_dag, store, llm_batch_home):
    """The Trigger form's run with an input path outside the user's area (here: another
    owner's folder) or a model that is not prepared: a FAILED job naming why, prepare and
    finalize fail once with the reason (no traceback as the only explanation)."""
    job_id = "job_refused_path"
    dag_run = batch_dag.test(run_conf={"job_id": job_id, "input_uri": "/etc/passwd"})
    assert dag_run.state == "failed"
    reason = _refused(dag_run)
    assert "input_uri" in reason, reason
    _assert_refused_job(store, job_id, dag_run, "input_uri")
    states = _states(dag_run)
    assert states["prepare"] == "failed" and states["finalize"] == "failed", states


def test_a_run_naming_a_model_that_is_not_prepared_is_refused_with_a_failed_job(store):
    from llm_batch.pipeline import steps

    settings = get_settings().model_copy(update={"check_models_at_submit": True})
    with pytest.raises(steps.JobRejected) as refused:
        steps.register(store, settings, {"job_id": "job_not_prepared", "input_uri": "/x.jsonl",
                                         "model": "smollm2-135m-instruct"}, "run_not_prepared", trusted=True)
    assert "llm-batch models prepare" in str(refused.value)
    job = store.get_job("job_not_prepared")
    assert job.status.value == "FAILED" and "llm-batch models prepare" in job.status_reason


@pytest.mark.engine
def test_success_with_bad_lines_two_shards(batch_dag, store, tiny_model_dir, llm_batch_home):
    lines = [_request(i) for i in range(12)]
    lines[3] = b"{not json"
    lines[8] = orjson.dumps({"custom_id": "req-8", "body": {"messages": [], "max_tokens": 8}})
    uri = _write_input(llm_batch_home, "bad_lines", lines)

    dag_run = _run(batch_dag, {"job_id": "job_ok", "input_uri": uri, "model": TINY_MODEL, "data_parallelism": 2,
                               "priority": "high"})

    job = store.get_job("job_ok")
    assert dag_run.state == "success"
    assert job.status == JobStatus.SUCCEEDED
    assert (job.total, job.succeeded, job.failed) == (12, 10, 2)
    layout = JobLayout(get_settings().work_uri, job.id)
    outputs, errors = _assert_every_request_once(layout, job, 12)
    assert [r["custom_id"] for r in outputs] == [f"req-{i}" for i in range(12) if i not in (3, 8)]
    assert [e["line"] for e in errors] == [4, 9]
    assert all(r["response"]["status_code"] == 200 for r in outputs)
    assert store.get_file(job.output_file_id).uri == layout.output_jsonl
    assert store.get_file(job.error_file_id).uri == layout.errors_jsonl
    assert job.completed_at is not None and job.dag_run_id == dag_run.run_id
    # One mapped shard task, its instances in the run's lane (shard_routing's cluster policy).
    shards = [ti for ti in dag_run.get_task_instances() if ti.task_id == "run_shard"]
    assert sorted(ti.map_index for ti in shards) == [0, 1]
    assert {(ti.pool, ti.priority_weight) for ti in shards} == {("llm_batch_local", 100)}


def _worker_pids() -> list[int]:
    """The worker processes the runner started (each leads its own process group)."""
    import psutil

    return [
        p.pid
        for p in psutil.Process().children(recursive=True)
        if "llm_batch.cli.main" in " ".join(p.cmdline()) and "worker" in p.cmdline() and os.getpgid(p.pid) == p.pid
    ]


@pytest.mark.engine
def test_shard_killed_once_retries_and_resumes(batch_dag, store, tiny_model_dir, llm_batch_home):
    # The DAG's dedicated worker path (a worker process per shard; the e2e stack's kill test
    # kills a warm engine).
    dag = with_shard_settings(batch_dag, get_settings().model_copy(update={"warm_engines": False}))
    n = 60
    # min_tokens: the random model hits EOS early. The shard holds after 20 results (the
    # worker's hold point, checkpointed first): the kill lands mid-shard by construction,
    # and leaves those results behind for the retry.
    uri = _write_input(llm_batch_home, "resume", [_request(i, max_tokens=16, min_tokens=16) for i in range(n)])
    layout = JobLayout(get_settings().work_uri, "job_resume")
    shard = layout.shard(0)
    hold_shards(layout, 20)

    def kill_mid_shard() -> None:
        _wait_for(lambda: _progress_done(shard.progress) >= 20, 900, "the shard held", poll=KILL_POLL_S)
        pids = _worker_pids()
        assert pids, "no worker process found"
        os.killpg(pids[0], signal.SIGKILL)
        assert count_results(shard.results) < n, "the shard ended before the kill"

    dag_run = _run(dag, {"job_id": "job_resume", "input_uri": uri, "model": TINY_MODEL,
                               "model_config": {"engine_args": {"max_num_seqs": 32}}}, during=kill_mid_shard)

    job = store.get_job("job_resume")
    assert job.status == JobStatus.SUCCEEDED, job.status_reason
    _assert_every_request_once(layout, job, n)
    progress = read_progress(shard.progress)
    assert progress.resumed > 0, "the retry did not resume from the checkpoint"
    tries = [ti.try_number for ti in dag_run.get_task_instances() if ti.task_id.startswith("run_shard") and ti.map_index >= 0]
    # One shard, retried after the kill (>= 2: the shared test venv has made an attempt fail
    # on its own before, and retrying is exactly what should happen then).
    assert len(tries) == 1 and tries[0] >= 2


@pytest.mark.engine
def test_cancel_mid_run(batch_dag, store, tiny_model_dir, llm_batch_home):
    # The shard holds after 3 results (the worker's hold point): the cancel, which takes a few
    # seconds to travel (store, runner, marker), finds it mid-run by construction.
    n = 100
    uri = _write_input(llm_batch_home, "cancel", [_request(i, max_tokens=16, min_tokens=16) for i in range(n)])
    layout = JobLayout(get_settings().work_uri, "job_cancel")
    hold_shards(layout, 3)

    def cancel_when_running() -> None:
        _wait_for(lambda: _progress_done(layout.shard(0).progress) >= 3, 900, "the shard held")
        # As the API does it: only the store's flag; the runner mirrors it to the marker.
        store.request_cancel("job_cancel", reason="test")

    dag_run = _run(batch_dag, {"job_id": "job_cancel", "input_uri": uri, "model": TINY_MODEL,
                               "model_config": {"engine_args": {"max_num_seqs": 8}}}, during=cancel_when_running)

    job = store.get_job("job_cancel")
    assert job.status == JobStatus.CANCELLED, job.status_reason
    # Not a red failed run; its finalize shows skipped in the grid.
    states = {ti.task_id: ti.state for ti in dag_run.get_task_instances()}
    assert dag_run.state == "success" and states["finalize"] == "skipped", (dag_run.state, states)
    outputs, errors = _assert_every_request_once(layout, job, n)
    assert 0 < len(outputs) < n
    assert any(e["error"]["code"] == "batch_cancelled" for e in errors)


@pytest.mark.engine
def test_deadline_mid_run(batch_dag, store, tiny_model_dir, llm_batch_home):
    # The shard holds after 2 results (the worker's hold point), so the deadline always falls
    # before the end: during the engine's start on a loaded machine, mid-run on a quiet one;
    # either way every request has one outcome. (Partial results past the first ones are
    # asserted on the real stack: tests/e2e/test_stack.py's deadline test.)
    n, max_runtime = 200, 12
    uri = _write_input(llm_batch_home, "deadline",
                       [_request(i, max_tokens=16, min_tokens=16) for i in range(n)])
    hold_shards(JobLayout(get_settings().work_uri, "job_deadline"), 2)
    started = time.monotonic()

    # The cancel test's engine configuration: the hold point, not a slow engine, places the fault.
    _run(batch_dag, {"job_id": "job_deadline", "input_uri": uri, "model": TINY_MODEL, "max_runtime_sec": max_runtime,
                     "model_config": {"engine_args": {"max_num_seqs": 8}}})

    job = store.get_job("job_deadline")
    assert job.status == JobStatus.TIMEOUT_EXCEEDED, job.status_reason
    layout = JobLayout(get_settings().work_uri, job.id)
    outputs, errors = _assert_every_request_once(layout, job, n)
    assert len(outputs) < n and errors[-1]["error"]["code"] == "batch_expired"
    # Stopped at the deadline (+ the kill grace at worst), not after finishing the batch.
    assert time.monotonic() - started < max_runtime + get_settings().cancel_grace_seconds + 60
