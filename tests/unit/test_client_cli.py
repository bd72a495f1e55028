"""The REST client and the job commands against a stub transport (fast; the real stack is
tests/e2e): route choice, request bodies, error messages, exit codes."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from llm_batch.cli import jobs as jobs_command
from llm_batch.infra import api_client as client_module
from llm_batch.infra.api_client import ApiError, BatchClient, scale_content, uses_mistral_route

JOB = {
    "id": "job_1", "status": "QUEUED", "endpoint": "/v1/chat/completions", "model": "m",
    "total_requests": 0, "completed_requests": 0, "succeeded_requests": 0, "failed_requests": 0,
    "created_at": 1, "errors": [],
}
# The same job as the native route (GET /v1/jobs/{id}) answers it: job() and jobs() read that.
NATIVE_JOB = {
    "id": "job_1", "status": "QUEUED", "terminal": False, "endpoint": "/v1/chat/completions", "model": "m",
    "counts": {"total": 0, "completed": 0, "succeeded": 0, "failed": 0}, "created_at": 1,
}


def _batch(tmp_path: Path, count: int = 3) -> Path:
    path = tmp_path / "in.jsonl"
    lines = [json.dumps({"custom_id": f"c{i}", "body": {"messages": [{"role": "user", "content": str(i)}]}})
             for i in range(count)]
    path.write_text("\n".join(lines[:1] + [""] + lines[1:]) + "\n")  # a blank line is skipped
    return path


class Recorder:
    """A stub API: records requests, answers from `routes` ((method, path) -> response)."""

    def __init__(self, routes: dict[tuple[str, str], httpx.Response]):
        self.routes = routes
        self.seen: list[httpx.Request] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.seen.append(request)
        return self.routes.get((request.method, request.url.path), httpx.Response(404, json={"detail": "no route"}))

    def client(self) -> BatchClient:
        return BatchClient("http://stub/batch", "key-1", transport=httpx.MockTransport(self))


@pytest.mark.parametrize(
    ("fmt", "shards", "runtime", "mistral"),
    [("jsonl", 1, None, True), ("jsonl", 1, 7200, True), ("jsonl", 2, None, False),
     ("jsonl", 1, 90, False), ("scale-v2", 1, None, False)],
)
def test_route_choice(fmt, shards, runtime, mistral):
    assert uses_mistral_route(fmt, shards, runtime) is mistral
    assert uses_mistral_route(fmt, shards, runtime, {"engine_args": {"max_num_seqs": 2}}) is False


def test_scale_content_keeps_bodies_in_order_and_names_bad_lines(tmp_path):
    assert [item["messages"][0]["content"] for item in scale_content(_batch(tmp_path), "jsonl")] == ["0", "1", "2"]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"custom_id": "a", "body": {}}\n{"custom_id": "b"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: no 'body' object"):
        scale_content(bad, "jsonl")


def test_one_shard_goes_through_upload_and_the_mistral_route(tmp_path):
    stub = Recorder({
        ("POST", "/batch/v1/files"): httpx.Response(200, json={"id": "file-1"}),
        ("POST", "/batch/v1/batch/jobs"): httpx.Response(200, json=JOB),
    })
    job = stub.client().submit(_batch(tmp_path), endpoint="/v1/chat/completions", model="m", max_runtime_sec=7200)
    assert job.id == "job_1" and not job.terminal
    body = json.loads(stub.seen[1].content)
    assert body == {"input_files": ["file-1"], "endpoint": "/v1/chat/completions", "model": "m", "timeout_hours": 2}
    assert stub.seen[0].headers["authorization"] == "Bearer key-1"


def test_shards_go_through_the_scale_route_as_data_parallelism(tmp_path):
    stub = Recorder({
        ("POST", "/batch/v2/batch-completions"): httpx.Response(200, json={"job_id": "job_1"}),
        ("GET", "/batch/v1/jobs/job_1"): httpx.Response(200, json=NATIVE_JOB),
    })
    stub.client().submit(_batch(tmp_path), endpoint="/v1/chat/completions", model="m", shards=3,
                         output_path="/srv/out.json")
    body = json.loads(stub.seen[0].content)
    assert body["data_parallelism"] == 3 and body["model_config"] == {"model": "m"}
    assert body["output_data_path"] == "/srv/out.json" and len(body["content"]) == 3


def test_api_errors_carry_message_and_parameter():
    stub = Recorder({("GET", "/batch/v1/jobs/x"): httpx.Response(
        400, json={"detail": "model 'q' is unknown", "param": "model"})})
    with pytest.raises(ApiError) as caught:
        stub.client().job("x")
    assert (caught.value.status, caught.value.message, caught.value.param) == (400, "model 'q' is unknown", "model")


@pytest.mark.parametrize(("native", "status", "code"), [("SUCCEEDED", "SUCCESS", 0), ("FAILED", "FAILED", 1),
                                                        ("CANCELLED", "CANCELLED", 3),
                                                        ("TIMEOUT_EXCEEDED", "TIMEOUT_EXCEEDED", 4)])
def test_job_wait_exit_codes(monkeypatch, capsys, native, status, code):
    stub = Recorder({("GET", "/batch/v1/jobs/job_1"): httpx.Response(
        200, json={**NATIVE_JOB, "status": native, "terminal": True})})
    monkeypatch.setattr(client_module.BatchClient, "from_env", classmethod(lambda cls: stub.client()))
    from llm_batch.cli.main import main

    assert main(["job", "job_1", "--wait"]) == code
    assert status in capsys.readouterr().out


def test_http_and_usage_errors_exit_2(monkeypatch, capsys, tmp_path):
    stub = Recorder({})
    monkeypatch.setattr(client_module.BatchClient, "from_env", classmethod(lambda cls: stub.client()))
    from llm_batch.cli.main import main

    assert main(["cancel", "nope"]) == jobs_command.EXIT_USAGE
    assert "HTTP 404" in capsys.readouterr().err
    assert main(["submit", str(tmp_path / "missing.jsonl"), "--model", "m"]) == jobs_command.EXIT_USAGE
    assert "no such file" in capsys.readouterr().err


def test_no_api_key_is_a_clear_usage_error(monkeypatch, capsys, tmp_path):
    monkeypatch.delenv("LLM_BATCH_API_KEY", raising=False)
    monkeypatch.setenv("LLM_BATCH_API_URL", "http://127.0.0.1:9/batch")
    from llm_batch.core.config import Settings

    monkeypatch.setattr(client_module, "get_settings", lambda: Settings(home=tmp_path))
    from llm_batch.cli.main import main

    assert main(["jobs"]) == 2
    assert "llm-batch up" in capsys.readouterr().err


def test_reads_ride_out_a_busy_server_but_not_forever(monkeypatch):
    monkeypatch.setattr("tenacity.nap.time.sleep", lambda seconds: None)
    answers = iter([httpx.Response(500, json={"detail": "database is locked"}), httpx.Response(200, json=NATIVE_JOB)])
    api = BatchClient("http://stub/batch", "k", transport=httpx.MockTransport(lambda request: next(answers)))
    assert api.job("job_1").id == "job_1"

    calls = []
    always = BatchClient("http://stub/batch", "k", transport=httpx.MockTransport(
        lambda request: calls.append(request) or httpx.Response(500, json={"detail": "database is locked"})))
    with pytest.raises(ApiError, match="database is locked"):
        always.job("job_1")
    assert len(calls) == 4


def test_a_busy_airflow_is_asked_again():
    """Airflow on SQLite answers 500 "database is locked" while its scheduler writes (seen
    once in five `llm-batch up`): the CLI and `up` try again; a lasting error is returned."""
    import httpx

    from llm_batch.infra.api_client import send_with_retries

    answers = iter([500, 500, 200])
    calls = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request.url.path)
        return httpx.Response(next(answers), json={"detail": "database is locked"})

    with httpx.Client(transport=httpx.MockTransport(handler), base_url="http://airflow") as client:
        assert send_with_retries(lambda: client.patch("/api/v2/dags/llm_batch_housekeeping")).status_code == 200
        assert len(calls) == 3
        lasting = iter([503] * 10)
        answers = lasting
        assert send_with_retries(lambda: client.get("/api/v2/x")).status_code == 503
