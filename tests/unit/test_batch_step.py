"""The batch step for users' DAGs without a server: job ids, request bodies, the trigger's
serialisation and polling, the manifest and the task's pass/fail rule, the decorator's
registration (the real stack: tests/e2e/test_batch_step.py)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

pytest.importorskip("airflow.sdk")

from llm_batch.airflow.hooks.llm_batch import LLMBatchApiError, LLMBatchHook, base_url_of  # noqa: E402
from llm_batch.airflow.operators import batch_step  # noqa: E402
from llm_batch.airflow.operators.batch_step import LLMBatchOperator, manifest_of, step_job_id  # noqa: E402
from llm_batch.airflow.triggers import batch_job as triggers  # noqa: E402
from llm_batch.airflow.triggers.batch_job import BatchJobTrigger  # noqa: E402

pytestmark = pytest.mark.airflow


def _job(status="SUCCEEDED", total=3, succeeded=3, failed=0, **extra):
    return {"id": "af-1", "status": status, "terminal": status in ("SUCCEEDED", "FAILED", "CANCELLED", "TIMEOUT_EXCEEDED"),
            "counts": {"total": total, "completed": succeeded + failed, "succeeded": succeeded, "failed": failed},
            "usage": {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3, "engine_seconds": 0.5},
            "output_file_id": "file-out", "error_file_id": "file-err", "output_uri": None, "dag_run_id": "r", **extra}


def test_job_id_is_stable_per_task_instance_and_differs_between_them():
    one = step_job_id("d", "run-1", "t", -1)
    assert one == step_job_id("d", "run-1", "t", -1) and one.startswith("af-") and len(one) == 35
    others = {step_job_id("d", "run-2", "t", -1), step_job_id("d", "run-1", "u", -1), step_job_id("d", "run-1", "t", 0),
              step_job_id("d", "run-1", "t", 1)}
    assert one not in others and len(others) == 4
    # Keyed by the connection's API key: nobody without it can work out a future run's id.
    keyed = step_job_id("d", "run-1", "t", -1, "key-of-alice")
    assert keyed == step_job_id("d", "run-1", "t", -1, "key-of-alice") != step_job_id("d", "run-1", "t", -1, "other")
    assert keyed != one and keyed.startswith("af-") and len(keyed) == 35


def test_bodies_from_each_input_and_exactly_one():
    op = LLMBatchOperator(task_id="t", model="m", prompts=["a", "b"], system_prompt="be brief",
                          request_params={"max_tokens": 4}, labels={"team": "x"}, output_uri="/o.jsonl")
    body = op.job_body("af-1")
    assert [r["custom_id"] for r in body["requests"]] == ["0", "1"]
    assert body["requests"][1]["body"] == {"max_tokens": 4, "messages": [
        {"role": "system", "content": "be brief"}, {"role": "user", "content": "b"}]}
    assert body["id"] == "af-1" and body["output_uri"] == "/o.jsonl" and body["labels"]["team"] == "x"
    bare = LLMBatchOperator(task_id="t", model="m", requests=[{"messages": []}, {"custom_id": "k", "body": {}}, 7])
    assert bare.job_body("x")["requests"] == [{"custom_id": "0", "body": {"messages": []}}, {"custom_id": "k", "body": {}}, 7]
    assert LLMBatchOperator(task_id="t", model="m", input_uri="/in.jsonl").job_body("x")["input_uri"] == "/in.jsonl"
    for inputs in ({}, {"prompts": ["a"], "input_uri": "/x"}):
        with pytest.raises(ValueError, match="exactly one"):
            LLMBatchOperator(task_id="t", model="m", **inputs).job_body("x")
    with pytest.raises(ValueError, match="max_failed_fraction"):
        LLMBatchOperator(task_id="t", model="m", prompts=["a"], max_failed_fraction=2)


def test_trigger_serialize_round_trips():
    trigger = BatchJobTrigger(job_id="af-1", llm_batch_conn_id="c", poll_interval=0.5, end_time=123.0, max_poll_errors=2)
    path, kwargs = trigger.serialize()
    assert path == "llm_batch.airflow.triggers.batch_job.BatchJobTrigger"
    module, _, name = path.rpartition(".")
    again = getattr(__import__(module, fromlist=[name]), name)(**kwargs)
    assert again.serialize() == (path, kwargs)


def _events(trigger):
    async def collect():
        return [event async for event in trigger.run()]

    return asyncio.run(collect())


def test_trigger_polls_until_terminal_and_rides_out_transient_errors(monkeypatch):
    answers = iter([_job("RUNNING"), LLMBatchApiError(503, "busy"), _job("SUCCEEDED")])

    async def aget_job(self, job_id):
        answer = next(answers)
        if isinstance(answer, Exception):
            raise answer
        return answer

    monkeypatch.setattr(LLMBatchHook, "aget_job", aget_job)
    events = _events(BatchJobTrigger(job_id="af-1", poll_interval=0))
    assert len(events) == 1 and events[0].payload["status"] == "ended" and events[0].payload["job"]["status"] == "SUCCEEDED"

    async def gone(self, job_id):
        raise LLMBatchApiError(404, "No job found")

    monkeypatch.setattr(LLMBatchHook, "aget_job", gone)
    assert _events(BatchJobTrigger(job_id="af-1", poll_interval=0))[0].payload["status"] == "error"


def test_manifest_and_pass_fail_rule():
    from airflow.sdk import AssetAlias
    from airflow.sdk.execution_time.context import OutletEventAccessors

    from llm_batch.airflow.operators.batch_step import STEP_RESULTS_ALIAS, step_asset_uri

    manifest = manifest_of(_job(failed=1, succeeded=2), "http://h/batch")
    assert manifest["request_count"] == 3 and manifest["succeeded"] == 2 and manifest["errored"] == 1
    assert manifest["missing"] == 0 and manifest["result_uri"] == "http://h/batch/v1/files/file-out/content"
    pushed = {}
    ti = SimpleNamespace(xcom_push=lambda key, value: pushed.setdefault(key, value))
    strict = LLMBatchOperator(task_id="t", model="m", prompts=["a"])
    with pytest.raises(Exception, match="1 of 3 requests failed"):
        strict.execute_complete({"ti": ti}, {"status": "ended", "job_id": "af-1", "job": _job(failed=1, succeeded=2)})
    assert pushed["manifest"]["errored"] == 1
    tolerant = LLMBatchOperator(task_id="t", model="m", prompts=["a"], max_failed_fraction=0.5)
    events = OutletEventAccessors()
    done = tolerant.execute_complete({"ti": ti, "outlet_events": events},
                                     {"status": "ended", "job_id": "af-1", "job": _job(failed=1, succeeded=2)})
    assert done["errored"] == 1
    # A finished step is an asset event: its manifest on the step's own asset.
    [event] = events[AssetAlias(STEP_RESULTS_ALIAS)].asset_alias_events
    assert event.dest_asset_key.uri == step_asset_uri(tolerant.dag_id, "t") and event.extra == done
    with pytest.raises(Exception, match="ended FAILED"):
        tolerant.execute_complete({"ti": ti}, {"status": "ended", "job_id": "af-1", "job": _job("FAILED", status_reason="x")})


def test_each_end_status_ends_the_step_so():
    """SUCCEEDED: success; CANCELLED: skipped (a decision, not a failure), the manifest of
    the partial results pushed; FAILED and TIMEOUT_EXCEEDED: failed."""
    from airflow.sdk.exceptions import AirflowFailException, AirflowSkipException
    from airflow.sdk.execution_time.context import OutletEventAccessors

    op = LLMBatchOperator(task_id="t", model="m", prompts=["a"], max_failed_fraction=1.0)
    outcomes = {}
    for status in ("SUCCEEDED", "CANCELLED", "FAILED", "TIMEOUT_EXCEEDED"):
        pushed = {}
        ti = SimpleNamespace(xcom_push=lambda key, value, pushed=pushed: pushed.setdefault(key, value))
        try:
            op.execute_complete({"ti": ti, "outlet_events": OutletEventAccessors()},
                                {"status": "ended", "job_id": "af-1", "job": _job(status, failed=1, succeeded=1)})
            outcomes[status] = "success"
        except AirflowSkipException:
            outcomes[status] = "skipped"
            assert pushed["manifest"]["succeeded"] == 1 and pushed["manifest"]["errored"] == 1
        except AirflowFailException:  # no retry: it would attach to this same ended job
            outcomes[status] = "failed"
    assert outcomes == {"SUCCEEDED": "success", "CANCELLED": "skipped", "FAILED": "failed", "TIMEOUT_EXCEEDED": "failed"}
    # Other failures (a lost API call, Airflow's own deferral race) are retried: a try
    # attaches to the step's one job.
    assert op.retries == 2 and LLMBatchOperator(task_id="u", model="m", prompts=["a"], retries=0).retries == 0


def test_execute_reattaches_fails_fast_on_refusals_and_cancels_on_kill(monkeypatch):
    created, cancelled = [], []
    monkeypatch.setattr(LLMBatchHook, "create_job", lambda self, body: created.append(body) or _job())
    monkeypatch.setattr(LLMBatchHook, "cancel_job", lambda self, job_id: cancelled.append(job_id) or _job("CANCELLING"))
    monkeypatch.setattr(LLMBatchOperator, "_base_url", lambda self: None)
    monkeypatch.setattr(LLMBatchHook, "job_id_secret", lambda self: "the-key")
    ti = SimpleNamespace(dag_id="d", run_id="r", task_id="t", map_index=-1, xcom_push=lambda key, value: None)
    op = LLMBatchOperator(task_id="t", model="m", prompts=["a"])
    from airflow.sdk.execution_time.context import OutletEventAccessors

    context = {"ti": ti, "outlet_events": OutletEventAccessors()}
    first, second = op.execute(context), op.execute(context)
    assert created[0]["id"] == created[1]["id"] == step_job_id("d", "r", "t", -1, "the-key") and first == second
    op.on_kill()
    assert cancelled == [created[0]["id"]]

    def refuse(self, body):
        raise LLMBatchApiError(400, "model 'nope' is not in the registry", "model")

    monkeypatch.setattr(LLMBatchHook, "create_job", refuse)
    from airflow.sdk.exceptions import AirflowFailException

    with pytest.raises(AirflowFailException, match="field model"):
        LLMBatchOperator(task_id="t", model="nope", prompts=["a"]).execute({"ti": ti})


def test_connection_host_forms():
    conn = SimpleNamespace(conn_id="c", host="http://127.0.0.1:8080/", schema=None, port=None)
    assert base_url_of(conn) == "http://127.0.0.1:8080/batch"
    assert base_url_of(SimpleNamespace(conn_id="c", host="api", schema="https", port=443)) == "https://api:443/batch"


def test_decorator_is_registered_and_maps_the_return_value():
    from airflow.sdk import task

    from llm_batch.airflow.decorators.llm_batch import input_of, llm_batch_task

    assert task.llm_batch is llm_batch_task
    assert input_of(["a", "b"]) == {"prompts": ["a", "b"]}
    assert input_of([{"messages": []}]) == {"requests": [{"messages": []}]}
    assert input_of({"input_uri": "/x"}) == {"input_uri": "/x"}
    for bad in ("a", [], {"prompts": [], "requests": []}, 3):
        with pytest.raises(TypeError):
            input_of(bad)
    assert batch_step.INPUTS == ("prompts", "requests", "input_uri", "input_file_ids") and triggers


def test_the_operator_is_importable_as_the_docs_write_it():
    from llm_batch.airflow.operators import LLMBatchOperator as named

    assert named is LLMBatchOperator
    with pytest.raises(ImportError):
        from llm_batch.airflow.operators import NoSuchOperator  # noqa: F401
