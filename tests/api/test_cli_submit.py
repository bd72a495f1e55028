"""The one HTTP client of the API (llm_batch.infra.api_client.BatchClient) against the real
plugin app on a real port: ``llm-batch submit`` uploads the file and creates the job through
the native route for every option (shards, deadline, model_config, output, Scale files),
keeps the file's custom_ids, holds bounded memory for a large file, and reads jobs back in
the canonical words; the provider's LLMBatchHook speaks through the same client."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path
from types import SimpleNamespace

import orjson
import pytest

from tests.api.conftest import chat_lines

pytestmark = pytest.mark.airflow

CHAT = "/v1/chat/completions"
MODEL = "tiny-random-llama"
MIB = 1024 * 1024


@pytest.fixture()
def alice_client(live_server, creds):
    """alice's client of the live app, for checks."""
    from llm_batch.infra.api_client import BatchClient

    with BatchClient(f"{live_server}/batch", creds.keys["alice"]) as client:
        yield client


@pytest.fixture()
def main(live_server, creds, cli):
    """alice's ``llm-batch`` on the live app."""
    return cli(f"{live_server}/batch", creds.keys["alice"])


def _content(client, file_id: str) -> bytes:
    return b"".join(client.file_content(file_id))


def _file_with_unique_ids(path: Path, count: int) -> bytes:
    tag = uuid.uuid4().hex[:8]
    data = b"".join(
        orjson.dumps({"custom_id": f"{tag}-{i}", "body": {"messages": [{"role": "user", "content": f"say {i}"}],
                                                          "max_tokens": 4}}) + b"\n"
        for i in range(count)
    )
    path.write_bytes(data)
    return data


def test_submit_with_shards_deadline_and_model_config_uploads_and_creates_natively(
        alice_client, main, api_store, capsys, tmp_path):
    batch = tmp_path / "batch.jsonl"
    data = _file_with_unique_ids(batch, 5)
    assert main(["submit", str(batch), "--model", MODEL, "--shards", "2", "--max-runtime", "5400",
                 "--model-config", '{"engine_args": {"max_num_seqs": 2}}', "--new"]) == 0
    job_id = capsys.readouterr().out.strip().splitlines()[-1]  # (the server's log shares stdout here)

    job = api_store.get_job(job_id)
    assert job.dialect == "airflow" and job.owner == "alice"  # the native route's create
    assert (job.data_parallelism, job.max_runtime_sec, job.input_format) == (2, 5400, "jsonl")
    assert job.model_config["engine_args"] == {"max_num_seqs": 2}
    [file_id] = alice_client.get_job(job_id)["input_file_ids"]  # an uploaded file, not inline content
    assert _content(alice_client, file_id) == data  # the file as it is: its custom_ids are the job's
    assert alice_client.get_file(file_id)["bytes"] == len(data)

    view = alice_client.job(job_id)
    assert (view.status, view.endpoint, view.model, view.terminal) == ("QUEUED", CHAT, MODEL, False)
    assert main(["job", job_id]) == 0
    assert "status     QUEUED" in capsys.readouterr().out
    assert main(["jobs", "--limit", "50"]) == 0
    # QUEUED, or WAITING with its place while its run waits for Airflow to start it.
    assert any(line.split()[:2] in ([job_id, "QUEUED"], [job_id, "WAITING"])
               for line in capsys.readouterr().out.splitlines())
    assert main(["cancel", job_id]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1] in (f"{job_id}: CANCELLING", f"{job_id}: CANCELLED")


def test_the_same_submit_again_answers_the_same_job(alice_client, tmp_path):
    batch = tmp_path / "batch.jsonl"
    _file_with_unique_ids(batch, 3)
    options = {"endpoint": CHAT, "model": MODEL, "shards": 2, "max_runtime_sec": 90,
               "model_config": {"max_model_len": 512}, "metadata": {"team": "t"}}
    first = alice_client.submit(batch, **options)
    assert alice_client.submit(batch, **options).id == first.id
    assert alice_client.submit(batch, **{**options, "shards": 3}).id != first.id
    assert first.labels["team"] == "t"


def test_a_scale_v2_file_is_uploaded_as_jsonl_numbered_by_position(alice_client, api_store, tmp_path):
    items = [{"messages": [{"role": "user", "content": f"q{i}"}], "max_tokens": 3} for i in range(4)]
    scale = tmp_path / "scale.json"
    scale.write_text(json.dumps(items))
    job = alice_client.submit(scale, endpoint=CHAT, model=MODEL, input_format="scale-v2", shards=2, new=True)
    [file_id] = alice_client.get_job(job.id)["input_file_ids"]
    lines = [orjson.loads(line) for line in _content(alice_client, file_id).splitlines()]
    assert lines == [{"custom_id": str(i), "body": item} for i, item in enumerate(items)]
    assert api_store.get_job(job.id).data_parallelism == 2


def test_a_refused_create_names_the_field(main, capsys, tmp_path):
    batch = tmp_path / "batch.jsonl"
    batch.write_bytes(chat_lines(2))
    assert main(["submit", str(batch), "--model", MODEL, "--model-config", '{"no_such_field": 1}', "--new"]) == 2
    err = capsys.readouterr().err
    assert "HTTP 400" in err and "model_config" in err


# The client in a process of its own, after one request has loaded everything a submit uses:
# its resident memory before the submit and its peak during it. The peak is the kernel's
# high-water mark (VmHWM, reset through /proc/self/clear_refs, so what imports took before
# does not hide it) and, as a cross-check, the highest RSS a thread sampled every 5 ms.
_MEASURE = textwrap.dedent("""
    import json, sys, threading, time
    from pathlib import Path
    from llm_batch.infra.api_client import BatchClient

    def status(field):
        with open("/proc/self/status") as lines:
            return next(int(line.split()[1]) for line in lines if line.startswith(field + ":"))  # KiB

    url, key, path = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    sampled, running = [0], [True]

    def sample():
        while running[0]:
            sampled[0] = max(sampled[0], status("VmRSS"))
            time.sleep(0.005)

    with BatchClient(url, key) as client:
        client.jobs(limit=1)
        before = status("VmRSS")
        with open("/proc/self/clear_refs", "w") as clear:
            clear.write("5")  # VmHWM := VmRSS
        sampler = threading.Thread(target=sample)
        sampler.start()
        job = client.submit(path, endpoint="/v1/chat/completions", model="tiny-random-llama", shards=2,
                            max_runtime_sec=5400, model_config={"engine_args": {"max_num_seqs": 2}}, new=True)
        running[0] = False
        sampler.join()
        peak = max(status("VmHWM"), sampled[0])
    print(json.dumps({"job_id": job.id, "before_kib": before, "peak_kib": peak}))
""")


def test_a_large_file_is_submitted_in_bounded_memory(live_server, creds, api_store, tmp_path):
    """An 80 MiB file of 220,000 requests with shards, a deadline and a model_config: the
    client's peak RSS grows by a small fraction of the file (it streams the upload)."""
    batch = tmp_path / "large.jsonl"
    line = orjson.dumps({"custom_id": "x" * 12, "body": {"messages": [{"role": "user", "content": "y" * 300}]}})
    with batch.open("wb") as out:
        for i in range(220_000):
            out.write(line.replace(b"x" * 12, f"r{i:011d}".encode(), 1) + b"\n")
    size = batch.stat().st_size
    assert size > 75 * MIB
    from llm_batch.infra.api_client import BatchClient

    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run([sys.executable, "-c", _MEASURE, f"{live_server}/batch", creds.keys["alice"], str(batch)],
                          capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    measured = json.loads(done.stdout.strip().splitlines()[-1])
    growth = (measured["peak_kib"] - measured["before_kib"]) * 1024
    print(f"file {size / MIB:.1f} MiB; client RSS {measured['before_kib'] / 1024:.1f} MiB before the submit, "
          f"peak {measured['peak_kib'] / 1024:.1f} MiB during it (growth {growth / MIB:.1f} MiB)")
    assert growth < size / 10, (growth, size)
    with BatchClient(f"{live_server}/batch", creds.keys["alice"]) as client:
        [file_id] = client.get_job(measured["job_id"])["input_file_ids"]
        assert client.get_file(file_id)["bytes"] == size
    assert api_store.get_job(measured["job_id"]).data_parallelism == 2


# -- the provider's hook: the same client, with the Airflow connection ------------------------


def _hook(live_server, key: str, monkeypatch):
    from llm_batch.airflow.hooks.llm_batch import LLMBatchHook

    hook = LLMBatchHook()
    conn = SimpleNamespace(conn_id="llm_batch_default", host=live_server, schema=None, port=None, password=key)
    monkeypatch.setattr(hook, "get_connection", lambda _: conn)

    async def aget_connection(_):
        return conn

    monkeypatch.setattr(hook, "aget_connection", aget_connection)
    return hook


def test_the_hook_reads_lists_cancels_and_maps_refusals(live_server, creds, alice_client, monkeypatch, tmp_path):
    from llm_batch.airflow.hooks.llm_batch import LLMBatchApiError
    from llm_batch.infra.api_client import ApiError, BatchClient

    hook = _hook(live_server, creds.keys["alice"], monkeypatch)
    assert isinstance(hook.get_conn(), BatchClient)
    label = uuid.uuid4().hex
    job_id = f"job_{uuid.uuid4().hex}"
    created = hook.create_job({"id": job_id, "model": MODEL, "labels": {"run": label},
                               "requests": [{"custom_id": "a", "body": {"messages": [{"role": "user", "content": "x"}]}}]})
    assert created["id"] == job_id and created["status"] == "QUEUED"
    assert hook.get_job(job_id)["id"] == job_id
    assert asyncio.run(hook.aget_job(job_id))["status"] == "QUEUED"
    assert [j["id"] for j in hook.list_jobs(label=f"run={label}", status=None)["data"]] == [job_id]

    batch = tmp_path / "b.jsonl"
    batch.write_bytes(chat_lines(3))
    file_id = alice_client.upload(batch)
    assert hook.get_file(file_id)["bytes"] == len(chat_lines(3))
    assert [r["custom_id"] for r in hook.read_results(file_id)] == ["req-0", "req-1", "req-2"]
    assert hook.cancel_job(job_id)["status"] in ("CANCELLING", "CANCELLED")

    with pytest.raises(LLMBatchApiError) as missing:
        hook.get_job("job_nope")
    assert (missing.value.status, missing.value.code) == (404, "not_found") and isinstance(missing.value, ApiError)
    with pytest.raises(LLMBatchApiError) as async_missing:
        asyncio.run(hook.aget_job("job_nope"))
    assert async_missing.value.status == 404
    with pytest.raises(LLMBatchApiError) as refused:
        hook.create_job({"model": "no-such-model", "requests": [{"body": {"messages": []}}]})
    assert refused.value.status == 400 and refused.value.param == "model"
    assert str(refused.value).startswith("llm-batch API 400: ") and "(field model)" in str(refused.value)
    with pytest.raises(LLMBatchApiError) as unauthorized:
        _hook(live_server, "not-a-key", monkeypatch).get_job(job_id)
    assert unauthorized.value.status == 401


def test_submit_takes_the_endpoint_from_the_lines_and_labels_and_priority_from_flags(
        main, api_store, capsys, tmp_path):
    """As `validate` does: a /v1/completions file without --endpoint is a completions job;
    lines naming two endpoints are refused before anything is sent, naming the lines."""

    tag = uuid.uuid4().hex[:8]
    completions = tmp_path / "completions.jsonl"
    completions.write_bytes(b"".join(orjson.dumps({
        "custom_id": f"{tag}-{i}", "method": "POST", "url": "/v1/completions",
        "body": {"model": MODEL, "prompt": f"say {i}", "max_tokens": 4}}) + b"\n" for i in range(3)))
    assert main(["submit", str(completions), "--label", "team=search", "--label", "run=a=b",
                 "--priority", "high", "--new"]) == 0
    job_id = capsys.readouterr().out.strip().splitlines()[-1]
    job = api_store.get_job(job_id)
    assert (job.endpoint, job.model) == ("/v1/completions", MODEL)
    assert job.labels["team"] == "search" and job.labels["run"] == "a=b"
    from llm_batch.core.config import get_settings

    assert job.priority == get_settings().priority_weights["high"]

    mixed = tmp_path / "mixed.jsonl"
    mixed.write_bytes(completions.read_bytes() + orjson.dumps({
        "custom_id": f"{tag}-x", "url": "/v1/chat/completions",
        "body": {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}}) + b"\n")
    assert main(["submit", str(mixed), "--new"]) == 2
    err = capsys.readouterr().err
    assert "'/v1/completions' (line 1)" in err and "'/v1/chat/completions' (line 4)" in err and "--endpoint" in err
    with pytest.raises(SystemExit) as refused:  # argparse's usage error
        main(["submit", str(completions), "--label", "no-equals-sign"])
    assert refused.value.code == 2 and "give KEY=VALUE" in capsys.readouterr().err


def test_a_submit_answered_by_an_earlier_one_says_so_with_the_job_as_it_is_now(main, api_store, capsys, tmp_path):
    from llm_batch.core.jobs import JobStatus

    batch = tmp_path / "again.jsonl"
    _file_with_unique_ids(batch, 2)
    assert main(["submit", str(batch), "--model", MODEL]) == 0
    first = capsys.readouterr()
    job_id = first.out.strip().splitlines()[-1]
    assert f"submitted {job_id} (QUEUED)" in first.err
    api_store.request_cancel(job_id, reason="test")  # it moves on from QUEUED
    status = api_store.get_job(job_id).status
    assert status != JobStatus.QUEUED
    assert main(["submit", str(batch), "--model", MODEL]) == 0  # the same file and options
    again = capsys.readouterr()
    assert again.out.strip().splitlines()[-1] == job_id
    assert f"already submitted: {job_id} ({JobStatus(status).value})" in again.err, again.err


def test_an_empty_output_check_is_refused_as_the_api_refuses_it(main, capsys, tmp_path):
    batch = tmp_path / "checked.jsonl"
    _file_with_unique_ids(batch, 1)
    assert main(["submit", str(batch), "--model", MODEL, "--output-check", "{}", "--new"]) != 0
    assert "output_check" in capsys.readouterr().err
