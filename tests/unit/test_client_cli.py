"""The REST client and the job commands against a stub transport (fast; the real API app:
tests/api/test_cli_submit.py; the real stack: tests/e2e): what a submission sends (upload,
then the native create, for every option), Scale files as JSONL, the canonical status
words, error messages, exit codes."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from llm_batch.cli import jobs as jobs_command
from llm_batch.infra import api_client as client_module
from llm_batch.infra.api_client import ApiError, BatchClient, scale_to_jsonl

# A job as the native route (POST/GET /v1/jobs) answers it.
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


def _submit_stub() -> Recorder:
    return Recorder({
        ("POST", "/batch/v1/files"): httpx.Response(200, json={"id": "file-1"}),
        ("POST", "/batch/v1/jobs"): httpx.Response(200, json=NATIVE_JOB),
    })


@pytest.mark.parametrize("options", [
    {},
    {"shards": 3, "max_runtime_sec": 90, "model_config": {"engine_args": {"max_num_seqs": 2}},
     "output_path": "/srv/out.jsonl", "metadata": {"team": "a"}},
])
def test_every_submission_is_an_upload_then_a_native_create(tmp_path, options):
    batch = _batch(tmp_path)
    stub = _submit_stub()
    job = stub.client().submit(batch, endpoint="/v1/chat/completions", model="m", **options)
    assert job.id == "job_1" and job.status == "QUEUED" and not job.terminal
    upload, create = stub.seen
    assert (upload.method, upload.url.path, create.method, create.url.path) == (
        "POST", "/batch/v1/files", "POST", "/batch/v1/jobs")
    assert batch.read_bytes() in upload.content  # the file as it is: its custom_ids are the job's
    assert upload.headers["authorization"] == create.headers["authorization"] == "Bearer key-1"
    assert upload.headers["idempotency-key"] == create.headers["idempotency-key"] + ":upload"
    expected = {"input_file_ids": ["file-1"], "endpoint": "/v1/chat/completions", "model": "m",
                "data_parallelism": options.get("shards", 1)}
    if options:
        expected |= {"max_runtime_sec": 90, "model_config": {"engine_args": {"max_num_seqs": 2}},
                     "output_uri": "/srv/out.jsonl", "labels": {"team": "a"}}
    assert json.loads(create.content) == expected


def test_the_cli_passes_every_option_and_refuses_a_bad_model_config(monkeypatch, capsys, tmp_path):
    stub = _submit_stub()
    monkeypatch.setattr(client_module.BatchClient, "from_env", classmethod(lambda cls, settings=None: stub.client()))
    from llm_batch.cli.main import main

    assert main(["submit", str(_batch(tmp_path)), "--model", "m", "--shards", "2", "--max-runtime", "5400",
                 "--model-config", '{"max_model_len": 512}', "--output", "out/r.jsonl", "--new"]) == 0
    assert capsys.readouterr().out.strip() == "job_1"
    body = json.loads(stub.seen[-1].content)
    assert (body["data_parallelism"], body["max_runtime_sec"], body["model_config"], body["output_uri"]) == (
        2, 5400, {"max_model_len": 512}, "out/r.jsonl")
    assert "idempotency-key" not in stub.seen[-1].headers  # --new
    with pytest.raises(SystemExit):
        main(["submit", str(_batch(tmp_path)), "--model", "m", "--model-config", "[1]"])
    assert "must be a JSON object" in capsys.readouterr().err


def test_submit_takes_the_model_from_the_lines_when_they_agree(monkeypatch, capsys, tmp_path):
    stub = _submit_stub()
    monkeypatch.setattr(client_module.BatchClient, "from_env", classmethod(lambda cls, settings=None: stub.client()))
    from llm_batch.cli.main import main

    def write(name: str, models: list) -> Path:
        path = tmp_path / name
        path.write_text("".join(json.dumps({"custom_id": f"c{i}", "body": {"messages": [], **({"model": m} if m else {})}})
                                + "\n" for i, m in enumerate(models)) + "not json\n")
        return path

    # Every line that names one names the same: that one (a line naming none runs it too).
    assert main(["submit", str(write("same.jsonl", ["tiny", None, "tiny"])), "--new"]) == 0
    assert json.loads(stub.seen[-1].content)["model"] == "tiny"
    sent = len(stub.seen)
    # Different models, or none at all: a usage error naming them, before any request.
    assert main(["submit", str(write("mixed.jsonl", ["a", "b", "a"])), "--new"]) == 2
    err = capsys.readouterr().err
    assert "2 models" in err and "'a' (line 1)" in err and "'b' (line 2)" in err and "--model" in err
    assert main(["submit", str(write("none.jsonl", [None, None])), "--new"]) == 2
    assert "no line names a model" in capsys.readouterr().err
    assert len(stub.seen) == sent
    # --model wins over the lines.
    assert main(["submit", str(write("given.jsonl", ["a", "b"])), "--model", "m", "--new"]) == 0
    assert json.loads(stub.seen[-1].content)["model"] == "m"


def test_scale_files_are_sent_as_jsonl_lines_numbered_by_position(tmp_path):
    v2 = tmp_path / "v2.json"
    v2.write_text(json.dumps([{"messages": [{"role": "user", "content": "a"}], "guided_choice": ["x", "y"]},
                              {"messages": [{"role": "user", "content": "b"}]}, 7]))
    stub = _submit_stub()
    stub.client().submit(v2, endpoint="/v1/chat/completions", model="m", input_format="scale-v2", shards=2)
    lines = [json.loads(line) for line in stub.seen[0].content.split(b"\n") if line.startswith(b'{"custom_id"')]
    assert [line["custom_id"] for line in lines] == ["0", "1", "2"]
    assert lines[0]["body"] == {"messages": [{"role": "user", "content": "a"}],
                                "structured_outputs": {"choice": ["x", "y"]}}
    assert lines[2]["body"] == 7  # not a request: the job's validation reports it as request 2's error
    assert json.loads(stub.seen[1].content)["data_parallelism"] == 2

    v1 = tmp_path / "v1.json"
    v1.write_text(json.dumps({"prompts": ["p0", "p1"], "max_new_tokens": 3, "temperature": 0.5}))
    with open(tmp_path / "out.jsonl", "wb") as out:
        assert scale_to_jsonl(v1, "scale-v1", "/v1/completions", out) == 2
    first = json.loads((tmp_path / "out.jsonl").read_text().splitlines()[0])
    assert first == {"custom_id": "0", "body": {"prompt": "p0", "max_tokens": 3, "temperature": 0.5,
                                                "skip_special_tokens": True}}


def test_a_scale_file_for_another_endpoint_or_unreadable_is_refused_before_any_request(tmp_path):
    stub = _submit_stub()
    v2 = tmp_path / "v2.json"
    v2.write_text(json.dumps([{"prompt": "a"}]))
    with pytest.raises(ValueError, match="its endpoint must be /v1/completions"):
        stub.client().submit(v2, endpoint="/v1/chat/completions", model="m", input_format="scale-v2")
    v1 = tmp_path / "v1.json"
    v1.write_text(json.dumps({"prompts": ["p"], "max_new_tokens": 3, "temperature": 0.5}))
    with pytest.raises(ValueError, match="scale-v1 content makes /v1/completions requests"):
        stub.client().submit(v1, endpoint="/v1/chat/completions", model="m", input_format="scale-v1")
    broken = tmp_path / "broken.json"
    broken.write_text('[{"prompt": "a"}, {')
    with pytest.raises(ValueError, match="broken.json: not valid JSON"):
        stub.client().submit(broken, endpoint="/v1/completions", model="m", input_format="scale-v2")
    assert stub.seen == []


def test_jobs_are_read_listed_and_cancelled_through_the_native_route():
    cancelling = {**NATIVE_JOB, "status": "CANCELLING"}
    stub = Recorder({
        ("GET", "/batch/v1/jobs/job_1"): httpx.Response(200, json={**NATIVE_JOB, "status": "VALIDATING"}),
        ("GET", "/batch/v1/jobs"): httpx.Response(200, json={"data": [NATIVE_JOB], "has_more": False}),
        ("POST", "/batch/v1/jobs/job_1/cancel"): httpx.Response(200, json=cancelling),
    })
    api = stub.client()
    assert api.job("job_1").status == "VALIDATING"
    assert [j.id for j in api.jobs(limit=5)] == ["job_1"] and stub.seen[1].url.params["limit"] == "5"
    assert api.cancel("job_1").status == "CANCELLING"
    assert all(r.url.path.startswith("/batch/v1/jobs") for r in stub.seen)


def test_api_errors_carry_message_parameter_and_code():
    stub = Recorder({
        ("GET", "/batch/v1/jobs/x"): httpx.Response(
            400, json={"detail": "model 'q' is unknown", "param": "model", "code": "unknown_model"}),
        ("POST", "/batch/v1/files"): httpx.Response(
            413, json={"error": {"message": "too large", "param": "file", "code": "file_too_large"}}),
        ("GET", "/batch/v1/jobs/y"): httpx.Response(502, text="bad gateway"),
    })
    api = stub.client()
    with pytest.raises(ApiError) as caught:
        api.job("x")
    assert (caught.value.status, caught.value.message, caught.value.param, caught.value.code) == (
        400, "model 'q' is unknown", "model", "unknown_model")
    with pytest.raises(ApiError) as caught:
        api.upload_stream(__import__("io").BytesIO(b"{}\n"), "a.jsonl")
    assert (caught.value.status, caught.value.param, caught.value.code) == (413, "file", "file_too_large")


@pytest.mark.parametrize(("status", "code"), [("SUCCEEDED", 0), ("FAILED", 1), ("CANCELLED", 3),
                                              ("TIMEOUT_EXCEEDED", 4)])
def test_job_wait_exit_codes(monkeypatch, capsys, status, code):
    stub = Recorder({("GET", "/batch/v1/jobs/job_1"): httpx.Response(
        200, json={**NATIVE_JOB, "status": status, "terminal": True, "status_reason": "why"})})
    monkeypatch.setattr(client_module.BatchClient, "from_env", classmethod(lambda cls, settings=None: stub.client()))
    from llm_batch.cli.main import main

    assert main(["job", "job_1", "--wait"]) == code
    shown = capsys.readouterr().out
    assert f"status     {status}" in shown
    assert ("note       why" in shown) is (status in ("FAILED", "TIMEOUT_EXCEEDED"))


def test_http_and_usage_errors_exit_2(monkeypatch, capsys, tmp_path):
    stub = Recorder({})
    monkeypatch.setattr(client_module.BatchClient, "from_env", classmethod(lambda cls, settings=None: stub.client()))
    from llm_batch.cli.main import main

    assert main(["cancel", "nope"]) == jobs_command.EXIT_USAGE
    assert "HTTP 404" in capsys.readouterr().err
    assert main(["submit", str(tmp_path / "missing.jsonl"), "--model", "m"]) == jobs_command.EXIT_USAGE
    assert "no such file" in capsys.readouterr().err


def test_no_api_key_is_a_clear_usage_error(capsys, tmp_path):
    from llm_batch.cli.main import main
    from llm_batch.core.config import Settings

    # No LLM_BATCH_API_KEY in the suite's environment, and a home where `up` stored none.
    assert main(["jobs"], settings=Settings(home=tmp_path)) == 2
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


def test_job_and_jobs_show_where_a_waiting_job_stands(monkeypatch, capsys):
    waiting = {"id": "job_w", "status": "RUNNING", "endpoint": "/v1/chat/completions", "model": "m",
               "counts": {"total": 3}, "created_at": 1, "labels": {},
               "queue": {"position": 2, "pool": "llm_batch_local", "waiting_for": "a slot of pool llm_batch_local (1 of 1 in use)"}}
    started = {**waiting, "id": "job_s", "queue": None}
    stub = Recorder({("GET", "/batch/v1/jobs/job_w"): httpx.Response(200, json=waiting),
                     ("GET", "/batch/v1/jobs"): httpx.Response(200, json={"data": [waiting, started], "has_more": False})})
    monkeypatch.setattr(client_module.BatchClient, "from_env", classmethod(lambda cls, settings=None: stub.client()))
    from llm_batch.cli.main import main

    assert main(["job", "job_w"]) == 0
    out = capsys.readouterr().out
    assert "status     RUNNING\n" in out
    assert "queue      #2: waits for a slot of pool llm_batch_local (1 of 1 in use)" in out
    assert main(["jobs"]) == 0
    rows = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()}
    assert "WAITING #2 in queue" in rows["job_w"] and "in queue" not in rows["job_s"]
