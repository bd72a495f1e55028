"""Each dialect over HTTP: create (the DAG run really triggered in Airflow's DB), live
counts, status words, output download, cancel, ownership. The run's progress is driven
through the job store as the pipeline does (the run itself is the pipeline's subject)."""

from __future__ import annotations

import orjson
import pytest

from llm_batch.core.jobs import JobStatus
from tests.api.conftest import chat_lines, dag_run_of, simulate_run

pytestmark = pytest.mark.airflow


def upload(client, headers, content: bytes):
    response = client.post("/v1/files", headers=headers, files={"file": ("in.jsonl", content)}, data={"purpose": "batch"})
    assert response.status_code == 200, response.text
    return response.json()["id"]


# -- OpenAI -------------------------------------------------------------------------------


def test_openai_batch_lifecycle(client, creds, api_store):
    alice = creds.key("alice")
    file_id = upload(client, alice, chat_lines(4))
    created = client.post(
        "/v1/batches", headers=alice,
        json={"input_file_id": file_id, "endpoint": "/v1/chat/completions", "completion_window": "24h", "metadata": {"k": "v"}},
    )
    assert created.status_code == 200, created.text
    batch = created.json()
    assert batch["status"] == "validating" and batch["input_file_id"] == file_id
    assert batch["expires_at"] - batch["created_at"] == 24 * 3600
    run = dag_run_of(batch["id"])
    assert run is not None and run["conf"]["job_id"] == batch["id"] and run["conf"]["input_file_ids"] == [file_id]

    progress = simulate_run(api_store, batch["id"], ok=3, failed=1)
    next(progress)
    live = client.get(f"/v1/batches/{batch['id']}", headers=alice).json()
    assert live["status"] == "in_progress"
    assert live["request_counts"] == {"total": 4, "completed": 1, "failed": 0}
    next(progress, None)
    done = client.get(f"/v1/batches/{batch['id']}", headers=alice).json()
    assert done["status"] == "completed" and done["request_counts"] == {"total": 4, "completed": 3, "failed": 1}
    assert done["completed_at"] >= done["created_at"]
    output = client.get(f"/v1/files/{done['output_file_id']}/content", headers=alice)
    assert output.status_code == 200 and len(output.content.splitlines()) == 3

    listed = client.get("/v1/batches", headers=alice, params={"limit": 100}).json()
    assert batch["id"] in [b["id"] for b in listed["data"]]
    assert client.get(f"/v1/batches/{batch['id']}", headers=creds.key("bob")).status_code == 404


def test_openai_cancel_writes_marker_and_stays_readable(client, creds, api_store):
    from llm_batch.core.config import get_settings
    from llm_batch.core.layout import JobLayout
    from llm_batch.infra import storage

    alice = creds.key("alice")
    file_id = upload(client, alice, chat_lines(2))
    batch = client.post("/v1/batches", headers=alice, json={"input_file_id": file_id, "endpoint": "/v1/chat/completions", "completion_window": "24h"}).json()
    assert client.post(f"/v1/batches/{batch['id']}/cancel", headers=creds.key("bob")).status_code == 404
    api_store.transition(batch["id"], JobStatus.VALIDATING)  # under way (a queued job ends at once)
    cancelled = client.post(f"/v1/batches/{batch['id']}/cancel", headers=alice)
    assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelling"
    assert cancelled.json()["cancelling_at"] is not None
    assert storage.exists(JobLayout(get_settings().work_uri, batch["id"]).cancel_marker)
    api_store.transition(batch["id"], JobStatus.CANCELLED)
    after = client.get(f"/v1/batches/{batch['id']}", headers=alice)
    assert after.status_code == 200 and after.json()["status"] == "cancelled"


def test_openai_create_errors_are_precise(client, creds):
    alice = creds.key("alice")
    file_id = upload(client, alice, chat_lines(1))
    cases = [
        ({"input_file_id": file_id, "endpoint": "/v1/conversations", "completion_window": "24h"}, 400, "endpoint"),
        ({"input_file_id": "file-nope", "endpoint": "/v1/chat/completions", "completion_window": "24h"}, 404, "input_file_id"),
        ({"input_file_id": file_id, "endpoint": "/v1/chat/completions", "completion_window": "48h"}, 422, "completion_window"),
    ]
    for body, status, param in cases:
        response = client.post("/v1/batches", headers=alice, json=body)
        assert response.status_code == status, response.text
        assert response.json()["error"]["param"] == param
    bob_file = upload(client, creds.key("bob"), chat_lines(1))
    response = client.post("/v1/batches", headers=alice, json={"input_file_id": bob_file, "endpoint": "/v1/chat/completions", "completion_window": "24h"})
    assert response.status_code == 404


def test_viewer_cannot_submit(client, creds):
    file_id = upload(client, creds.jwt("alice"), chat_lines(1))
    response = client.post("/v1/batches", headers=creds.jwt("vic"), json={"input_file_id": file_id, "endpoint": "/v1/chat/completions", "completion_window": "24h"})
    assert response.status_code in (403, 404)  # vic cannot see alice's file either
    response = client.post("/v1/batch/jobs", headers=creds.jwt("vic"), json={"requests": [{"body": {"messages": []}}], "endpoint": "/v1/chat/completions", "model": "tiny-random-llama"})
    assert response.status_code == 403


def test_trigger_failure_marks_job_failed_with_reason(client, creds, monkeypatch):
    from llm_batch.api import dag_trigger

    monkeypatch.setattr(dag_trigger, "DAG_ID", "no_such_dag")
    alice = creds.key("alice")
    file_id = upload(client, alice, chat_lines(1))
    response = client.post("/v1/batches", headers=alice, json={"input_file_id": file_id, "endpoint": "/v1/chat/completions", "completion_window": "24h"})
    assert response.status_code == 200
    batch = response.json()
    assert batch["status"] == "failed" and batch["failed_at"] is not None
    assert "no_such_dag" in batch["errors"]["data"][0]["message"]


# -- Mistral ------------------------------------------------------------------------------


def test_mistral_inline_job_lifecycle(client, creds, api_store):
    alice = creds.jwt("alice")
    requests = [{"custom_id": f"c{i}", "body": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}} for i in range(3)]
    created = client.post(
        "/v1/batch/jobs", headers=alice,
        json={"requests": requests, "endpoint": "/v1/chat/completions", "model": "tiny-random-llama", "metadata": {"team": "a"}, "timeout_hours": 2},
    )
    assert created.status_code == 200, created.text
    job = created.json()
    assert job["status"] == "QUEUED" and job["object"] == "batch" and job["total_requests"] == 0
    assert dag_run_of(job["id"]) is not None
    stored = api_store.get_job(job["id"])
    assert (stored.expires_at - stored.created_at).total_seconds() == 2 * 3600
    assert stored.owner == "alice"

    progress = simulate_run(api_store, job["id"], ok=3, failed=0)
    next(progress)
    assert client.get(f"/v1/batch/jobs/{job['id']}", headers=alice).json()["status"] == "RUNNING"
    next(progress, None)
    done = client.get(f"/v1/batch/jobs/{job['id']}", headers=alice).json()
    assert done["status"] == "SUCCESS" and done["succeeded_requests"] == 3 and len(done["outputs"]) == 3

    filtered = client.get("/v1/batch/jobs", headers=alice, params={"status": ["SUCCESS", "FAILED"], "metadata": '{"team": "a"}'}).json()
    assert job["id"] in [j["id"] for j in filtered["data"]] and filtered["total"] >= 1
    assert all(j["status"] in ("SUCCESS", "FAILED") for j in filtered["data"])
    queued_only = client.get("/v1/batch/jobs", headers=alice, params={"status": "QUEUED"}).json()
    assert job["id"] not in [j["id"] for j in queued_only["data"]]


def test_mistral_from_files_cancel_and_refusals(client, creds):
    alice = creds.key("alice")
    ids = [upload(client, alice, chat_lines(2)), upload(client, alice, chat_lines(1))]
    job = client.post("/v1/batch/jobs", headers=alice, json={"input_files": ids, "endpoint": "/v1/chat/completions", "model": "tiny-random-llama"}).json()
    assert job["input_files"] == ids
    assert dag_run_of(job["id"])["conf"]["input_file_ids"] == ids
    cancelled = client.post(f"/v1/batch/jobs/{job['id']}/cancel", headers=alice).json()
    assert cancelled["status"] == "CANCELLED"  # still queued: ended at once

    refusals = [
        ({"input_files": ids, "endpoint": "/v1/chat/completions", "agent_id": "ag_1"}, 400, "agent_id"),
        ({"input_files": ids, "endpoint": "/v1/chat/completions", "model": "tiny-random-llama", "timeout_hours": 169}, 422, "timeout_hours"),
        ({"endpoint": "/v1/chat/completions", "model": "tiny-random-llama"}, 400, "input_files"),
        ({"input_files": ids, "endpoint": "/v1/conversations", "model": "tiny-random-llama"}, 400, "endpoint"),
        ({"input_files": ids, "endpoint": "/v1/chat/completions", "model": "no-such-model"}, 400, "model"),
    ]
    for body, status, param in refusals:
        response = client.post("/v1/batch/jobs", headers=alice, json=body)
        assert response.status_code == status, (body, response.text)
        assert response.json()["param"] == param, response.text


# -- Scale --------------------------------------------------------------------------------


def test_scale_inline_lifecycle_priority_cancel(client, creds, api_store, alice_dir):
    alice = creds.key("alice")
    output_path = str(alice_dir / "scale-out" / "result.json")
    body = {
        "output_data_path": output_path,
        "content": [{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}] * 2,
        "model_config": {"model": "tiny-random-llama", "labels": {"team": "x"}},
        "data_parallelism": 2,
        "max_runtime_sec": 600,
        "priority": "high",
        "labels": {"product": "p"},
        "cpus": 4,
        "memory": "8Gi",
    }
    created = client.post("/v2/batch-completions", headers=alice, json=body)
    assert created.status_code == 200, created.text
    job = created.json()
    assert job["status"] == "queued" and job["priority"] == "high" and job["output_data_path"] == output_path
    assert job["model_config"]["model"] == "tiny-random-llama"
    stored = api_store.get_job(job["job_id"])
    assert stored.input_format == "scale-v2" and stored.endpoint == "/v1/chat/completions"
    assert (stored.expires_at - stored.created_at).total_seconds() == 600
    conf = dag_run_of(job["job_id"])["conf"]
    assert conf["data_parallelism"] == 2 and conf["priority"] == "high"

    updated = client.post(f"/v2/batch-completions/{job['job_id']}", headers=alice, json={"priority": "low"})
    assert updated.status_code == 200 and updated.json()["priority"] == "low" and updated.json()["success"] is True
    assert client.post(f"/v2/batch-completions/{job['job_id']}", headers=alice, json={"priority": "urgent"}).status_code == 400

    progress = simulate_run(api_store, job["job_id"], ok=2, failed=0)
    next(progress)
    running = client.get(f"/v2/batch-completions/{job['job_id']}", headers=alice).json()["job"]
    assert running["status"] == "running" and running["metadata"]["completed_requests"] == 1
    next(progress, None)
    done = client.get(f"/v2/batch-completions/{job['job_id']}", headers=alice).json()["job"]
    assert done["status"] == "completed" and done["completed_at"] is not None
    assert len(orjson.loads(open(output_path, "rb").read())) == 2
    assert client.post(f"/v2/batch-completions/{job['job_id']}/actions/cancel", headers=alice).json() == {"success": False}
    assert job["job_id"] in [j["job_id"] for j in client.get("/v2/batch-completions", headers=alice).json()["jobs"]]


def test_scale_from_path_cancel_and_refusals(client, creds, alice_dir):
    alice = creds.key("alice")
    input_path = alice_dir / "scale-in.json"
    input_path.write_bytes(orjson.dumps({"prompts": ["a", "b"], "max_new_tokens": 4, "temperature": 0.0}))
    base = {"input_data_path": str(input_path), "output_data_path": str(alice_dir / "o.json"), "model_config": {"model": "tiny-random-llama"}}
    job = client.post("/v2/batch-completions", headers=alice, json=base).json()
    assert job["input_data_path"] == str(input_path)
    cancel = client.post(f"/v2/batch-completions/{job['job_id']}/actions/cancel", headers=alice)
    assert cancel.json() == {"success": True}
    after = client.get(f"/v2/batch-completions/{job['job_id']}", headers=alice)
    assert after.status_code == 200 and after.json()["job"]["status"] == "cancelled"  # still queued: at once
    assert client.get(f"/v2/batch-completions/{job['job_id']}", headers=creds.key("bob")).status_code == 404

    refusals = [
        ({**base, "output_data_path": "/etc/llm-batch-out.json"}, 400, "output_data_path"),
        ({**base, "input_data_path": "s3://not-allowed-bucket/x.json"}, 400, "input_data_path"),
        ({**base, "input_data_path": str(alice_dir / "missing.json")}, 400, "input_data_path"),
        ({**base, "tool_config": {"name": "code_evaluator"}}, 400, "tool_config"),
        ({**base, "data_parallelism": 65}, 422, "data_parallelism"),
        ({**base, "max_runtime_sec": 172_801}, 422, "max_runtime_sec"),
        ({**base, "content": [{"prompt": "x"}]}, 400, "input_data_path"),
    ]
    for body, status, param in refusals:
        response = client.post("/v2/batch-completions", headers=alice, json=body)
        assert response.status_code == status, (body, response.text)
        assert response.json()["param"] == param, response.text


def test_scale_resources_pass_the_dags_params(client, creds, api_store, alice_dir):
    body = {
        "output_data_path": str(alice_dir / "gpu-out.json"),
        "content": [{"prompt": "x", "max_tokens": 2}],
        "model_config": {"model": "tiny-random-llama", "checkpoint_path": None},
        "gpus": 2,
        "gpu_type": "nvidia-hopper-h100-1g20gb",
        "nodes_per_worker": 1,
        "priority": "normal",
    }
    job = client.post("/v2/batch-completions", headers=creds.key("alice"), json=body).json()
    assert job["status"] == "queued", job  # a conf the Params refused would have failed the job
    conf = dag_run_of(job["job_id"])["conf"]
    assert (conf["gpus"], conf["gpu_type"], conf["nodes_per_worker"]) == (2, "nvidia-hopper-h100-1g20gb", 1)
    assert api_store.get_job(job["job_id"]).endpoint == "/v1/completions"


def test_scale_multi_node_workers_need_the_kubernetes_runner(client, creds, api_store, alice_dir, batch_api, monkeypatch):
    """nodes_per_worker > 1: a 400 naming the field and what to use instead on a local stack;
    with the Kubernetes runner the job is made and its run carries the node count, and the
    parallel sizes must fill gpus x nodes_per_worker."""
    alice = creds.key("alice")
    body = {
        "output_data_path": str(alice_dir / "multinode-out.json"),
        "content": [{"prompt": "x", "max_tokens": 2}],
        "model_config": {"model": "tiny-random-llama"},
        "gpus": 2,
        "nodes_per_worker": 2,
    }
    refused = client.post("/v2/batch-completions", headers=alice, json=body)
    assert refused.status_code == 400 and refused.json()["param"] == "nodes_per_worker", refused.text
    assert "needs the Kubernetes shard runner" in refused.text and "data_parallelism" in refused.text

    state = batch_api.state.llm_batch
    monkeypatch.setattr(state, "settings", state.settings.model_copy(update={"shard_runner": "kubernetes"}))
    job = client.post("/v2/batch-completions", headers=alice, json=body).json()
    assert job["status"] == "queued", job
    conf = dag_run_of(job["job_id"])["conf"]
    assert (conf["gpus"], conf["nodes_per_worker"]) == (2, 2)
    assert api_store.get_job(job["job_id"]).resources["nodes_per_worker"] == 2
    unfit = {**body, "model_config": {"model": "tiny-random-llama", "tensor_parallel_size": 2, "pipeline_parallel_size": 1}}
    response = client.post("/v2/batch-completions", headers=alice, json=unfit)
    assert response.status_code == 400 and response.json()["param"] == "model_config.tensor_parallel_size", response.text
    assert "gpus=2 x nodes_per_worker=2 = 4 GPUs" in response.text


def test_scale_model_config_is_checked_at_submission(client, creds, alice_dir):
    """A model_config field the worker would refuse is a 400 naming it, before any run."""
    response = client.post(
        "/v2/batch-completions",
        headers=creds.key("alice"),
        json={"output_data_path": str(alice_dir / "scale-out" / "refused.json"),
              "content": [{"prompt": "hi", "max_tokens": 4}],
              "model_config": {"model": "tiny-random-llama",
                               "engine_args": {"trust_remote_code": True}}},
    )
    assert response.status_code == 400, response.text
    assert "trust_remote_code" in response.text


def test_openai_usage_and_scale_figures_live_then_exact(client, creds, api_store):
    """OpenAI's Batch.usage (the SDK's BatchUsage): null before the run, live from the shard
    rows while it runs, the output lines' sum at the end; Scale has no usage field, so the
    figures ride in its metadata beside the counts (GPU-seconds = engine seconds x gpus)."""
    from openai.types import Batch

    from llm_batch.api.scale.models import BatchCompletionsJob
    from llm_batch.infra.api_client import JobView
    from tests.api.conftest import CACHED_TOKENS, COMPLETION_TOKENS, PROMPT_TOKENS

    alice = creds.key("alice")
    batch = client.post("/v1/batches", headers=alice, json={"input_file_id": upload(client, alice, chat_lines(3)),
                                                             "endpoint": "/v1/chat/completions", "completion_window": "24h"}).json()
    assert batch["usage"] is None and batch["model"]
    progress = simulate_run(api_store, batch["id"], ok=2, failed=1)
    next(progress)
    live = Batch.model_validate(client.get(f"/v1/batches/{batch['id']}", headers=alice).json())
    assert (live.usage.input_tokens, live.usage.output_tokens, live.usage.total_tokens) == (
        PROMPT_TOKENS, COMPLETION_TOKENS, PROMPT_TOKENS + COMPLETION_TOKENS)
    assert live.usage.input_tokens_details.cached_tokens == CACHED_TOKENS
    scale = BatchCompletionsJob.of(api_store.get_job(batch["id"]), None).metadata
    assert (scale["engine_seconds"], scale["gpu_seconds"], scale["tokens_per_second"]) == (2.0, 2.0, 2.0)
    # The native job carries the same rate, and the CLI's progress line reads it from there.
    native = client.get(f"/v1/jobs/{batch['id']}", headers=alice).json()
    assert native["usage"]["tokens_per_s"] == JobView.of(native).tokens_per_s == 2.0
    next(progress, None)
    done = client.get(f"/v1/batches/{batch['id']}", headers=alice).json()
    assert done["usage"] == {
        "input_tokens": 2 * PROMPT_TOKENS, "input_tokens_details": {"cached_tokens": 2 * CACHED_TOKENS},
        "output_tokens": 2 * COMPLETION_TOKENS, "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": 2 * (PROMPT_TOKENS + COMPLETION_TOKENS)}


def test_scale_update_reprioritizes_the_runs_waiting_tasks(client, creds, api_store, alice_dir):
    """The v2 update changes the priority of the run's tasks that have not started; a
    running task keeps its own."""
    from airflow.models.dagbag import DBDagBag
    from airflow.models.dagrun import DagRun
    from airflow.models.taskinstance import TaskInstance
    from airflow.utils.session import create_session
    from airflow.utils.state import TaskInstanceState

    from llm_batch.api.dag_trigger import run_id_for

    alice = creds.key("alice")
    created = client.post("/v2/batch-completions", headers=alice, json={
        "output_data_path": str(alice_dir / "reprioritized.json"), "content": [{"prompt": "x", "max_tokens": 2}],
        "model_config": {"model": "tiny-random-llama"}, "priority": "low"})
    assert created.status_code == 200, created.text
    job_id = created.json()["job_id"]
    with create_session() as session:  # the scheduler would make the run's task instances
        run = session.query(DagRun).filter(DagRun.run_id == run_id_for(job_id)).one()
        run.dag = DBDagBag().get_dag_for_run(run, session)
        run.verify_integrity(session=session, dag_version_id=run.created_dag_version_id)
        tasks = session.query(TaskInstance).filter(TaskInstance.run_id == run.run_id).all()
        assert tasks
        tasks[0].state = TaskInstanceState.RUNNING
        running_id, running_weight = tasks[0].task_id, tasks[0].priority_weight

    updated = client.post(f"/v2/batch-completions/{job_id}", headers=alice, json={"priority": "high"})
    assert updated.status_code == 200 and updated.json()["priority"] == "high"
    high = api_store.get_job(job_id).priority
    with create_session() as session:
        weights = {t.task_id: t.priority_weight for t in session.query(TaskInstance).filter(TaskInstance.run_id == run_id_for(job_id))}
    assert weights.pop(running_id) == running_weight
    assert weights and set(weights.values()) == {high}
    # The shard tasks made after plan take the new priority from the run's conf.
    from llm_batch.airflow.lanes import lane_of_run
    from llm_batch.core.config import get_settings

    with create_session() as session:
        run = session.query(DagRun).filter(DagRun.run_id == run_id_for(job_id)).one()
        assert lane_of_run(get_settings(), run.conf).priority_weight == high
