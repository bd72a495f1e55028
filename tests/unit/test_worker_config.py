"""Worker arguments: flags, LLM_BATCH_WORKER_* fallbacks, layout defaults, precise usage errors,
and the exits that happen before any engine loads."""

from __future__ import annotations

import argparse

import pytest

from llm_batch.core import exit_codes
from llm_batch.core.endpoints import Endpoint
from llm_batch.core.job_spec import ModerationShape
from llm_batch.core.layout import JobLayout
from llm_batch.core.records import BatchRequest, ResultRecord, dumps_line
from llm_batch.infra.progress import ShardState, read_progress
from llm_batch.infra.results import ResultsWriter
from llm_batch.runtime.worker import WorkerUsageError, parse_config, run_worker
from llm_batch.runtime.worker_args import GROUP_FLAGS, WORKER_FLAGS, add_pod_command

BASE = dict(job_id="job1", shard="2", requests=None, results=None, endpoint="/v1/chat/completions",
            model_config='{"model": "tiny-random-llama"}', work_uri="/w")


def test_uris_default_to_the_job_layout():
    config = parse_config(**BASE)
    shard = JobLayout("/w", "job1").shard(2)
    assert (config.requests, config.results, config.progress) == (shard.requests, shard.results, shard.progress)
    assert config.cancel_marker == JobLayout("/w", "job1").cancel_marker
    assert config.endpoint is Endpoint.CHAT_COMPLETIONS
    assert config.model_config == {"model": "tiny-random-llama"}
    assert config.deadline is None
    assert config.options.moderation_shape is ModerationShape.SCORES  # moderation results without "flagged"
    flagged = parse_config(**BASE, options='{"moderation_shape": "flagged"}')
    assert flagged.options.moderation_shape is ModerationShape.FLAGGED


@pytest.mark.parametrize(("change", "message"), [
    ({"job_id": None}, "--job-id is required"),
    ({"shard": "x"}, "--shard: not an integer"),
    ({"shard": None}, "--shard is required"),
    ({"endpoint": "/v1/conversations"}, "not supported"),
    ({"model_config": "{model"}, "--model-config: not JSON"),
    ({"model_config": "[1]"}, "must be a JSON object"),
    ({"model_config": None}, "--model-config is required"),
    ({"deadline": "tomorrow"}, "--deadline"),
    ({"options": '{"moderation_shape": "openai"}'}, "--options: moderation_shape: Input should be 'scores' or 'flagged'"),
])
def test_bad_arguments_are_named(change, message):
    with pytest.raises(WorkerUsageError, match=message):
        parse_config(**{**BASE, **change})


def test_flags_fall_back_to_environment():
    environ = {"LLM_BATCH_WORKER_JOB_ID": "from-env", "LLM_BATCH_WORKER_SHARD": "7",
               "LLM_BATCH_WORKER_MODEL_CONFIG": '{"model": "m"}', "LLM_BATCH_WORKER_DEADLINE": "1700000000.5"}
    parser = argparse.ArgumentParser(prog="llm-batch")
    # The worker's command as llm_batch.cli.worker registers it, in a pod given that environment.
    add_pod_command(parser.add_subparsers(dest="command"), "worker", "", "", (*WORKER_FLAGS, *GROUP_FLAGS), None,
                    environ=environ)
    args = parser.parse_args(["worker", "--shard", "3", "--endpoint", "/v1/completions"])
    assert (args.job_id, args.shard, args.deadline) == ("from-env", 3, 1700000000.5)
    assert args.model_config == '{"model": "m"}'


def _shard(home, n: int, job: str) -> JobLayout:
    layout = JobLayout(str(home / "work"), job)
    path = home / "work" / job / "shards" / "00000" / "requests.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"".join(
        dumps_line(BatchRequest(index=i, custom_id=f"c{i}", body={"messages": [{"role": "user", "content": "x"}]}))
        for i in range(n)))
    return layout


def _config(layout: JobLayout, model: str = "tiny-random-llama", **extra):
    return parse_config(job_id=layout.job_id, shard=0, requests=None, results=None,
                        endpoint=extra.pop("endpoint", "/v1/chat/completions"),
                        model_config={"model": model}, work_uri=layout.work_uri, **extra)


def test_unknown_model_is_a_usage_exit(llm_batch_home):
    layout = _shard(llm_batch_home, 2, "unknown-model")
    assert run_worker(_config(layout, "no-such-model")) == exit_codes.USAGE


def test_endpoint_the_model_cannot_serve_is_a_usage_exit(llm_batch_home, tiny_model_dir):
    layout = _shard(llm_batch_home, 2, "wrong-task")
    assert run_worker(_config(layout, endpoint="/v1/embeddings")) == exit_codes.USAGE


def test_missing_requests_file_is_a_usage_exit(llm_batch_home, tiny_model_dir):
    layout = JobLayout(str(llm_batch_home / "work"), "no-shard-file")
    assert run_worker(_config(layout)) == exit_codes.USAGE


def test_a_complete_shard_exits_done_without_an_engine(llm_batch_home, tiny_model_dir):
    layout = _shard(llm_batch_home, 3, "complete")
    with ResultsWriter.open(layout.shard(0).results) as writer:
        for i in range(3):
            writer.write(ResultRecord(index=i, custom_id=f"c{i}", status_code=200, body={}))
    assert run_worker(_config(layout)) == exit_codes.DONE
    progress = read_progress(layout.shard(0).progress)
    assert (progress.state, progress.done, progress.total, progress.resumed) == (ShardState.DONE, 3, 3, 3)


def test_a_past_deadline_stops_before_the_engine(llm_batch_home, tiny_model_dir):
    layout = _shard(llm_batch_home, 3, "late")
    assert run_worker(_config(layout, deadline="1")) == exit_codes.DEADLINE
    assert read_progress(layout.shard(0).progress).state == ShardState.DEADLINE
