"""``llm-batch estimate FILE`` against the real plugin app on a real port (alice's key): the
readable summary and ``--json`` of a file with a bad line, the model taken from the lines,
nothing left behind (no job, the uploaded file deleted), and a refusal's exit status."""

from __future__ import annotations

import orjson
import pytest

pytestmark = pytest.mark.airflow

MODEL = "tiny-random-llama"


@pytest.fixture()
def main(live_server, creds, cli):
    """alice's ``llm-batch`` on the live app."""
    return cli(f"{live_server}/batch", creds.keys["alice"])


def _file(tmp_path, model: str = MODEL):
    lines = [{"custom_id": f"r{i}", "body": {"model": model, "messages": [{"role": "user", "content": f"hi {i}"}],
                                             "max_tokens": 5}} for i in range(3)]
    lines.append({"custom_id": "bad", "body": {"model": model, "messages": 7}})
    path = tmp_path / "batch.jsonl"
    path.write_bytes(b"".join(orjson.dumps(line) + b"\n" for line in lines))
    return path


def test_estimate_prints_the_figures_and_leaves_nothing_behind(main, api_store, tiny_model_dir, capsys, tmp_path):
    path = _file(tmp_path)
    jobs = api_store.list_jobs(owner="alice", limit=1)[1]
    files = api_store.owner_usage("alice")["file_bytes"]

    assert main(["estimate", str(path)]) == 1  # the model from the lines; some lines bad
    out = capsys.readouterr().out
    assert f"4 lines read: 3 valid, 1 bad ({MODEL}, /v1/chat/completions)" in out
    assert "  line 4  invalid_body: " in out and "most output tokens 15" in out
    assert "prompt tokens      unknown" not in out and "expected start" in out

    assert main(["estimate", str(path), "--json"]) == 1
    answer = orjson.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert answer["object"] == "job.estimate" and (answer["valid"], answer["invalid"]) == (3, 1)
    assert answer["prompt_tokens"] > 0 and answer["max_output_tokens"] == 15

    assert api_store.list_jobs(owner="alice", limit=1)[1] == jobs  # no job
    assert api_store.owner_usage("alice")["file_bytes"] == files  # the upload was deleted again


def test_estimate_refusals_exit_2(main, capsys, tmp_path):
    assert main(["estimate", str(_file(tmp_path, model="no-such-model"))]) == 2
    assert "no-such-model" in capsys.readouterr().err
    assert main(["estimate", str(tmp_path / "missing.jsonl"), "--model", MODEL]) == 2
