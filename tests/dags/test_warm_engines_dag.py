"""batch_inference with warm engines (``LLM_BATCH_WARM_ENGINES``, on for the suite's in-process
DAG runs): dag.test(), the local runner, real ``llm-batch engine-host`` processes, tiny real model.

Two jobs run on one engine process in turn; then kill -9 of that process mid-shard: the
shard task's retry starts a new engine, resumes from the checkpoint, and every request has
exactly one result.
"""

from __future__ import annotations

import os
import signal

import psutil
import pytest

from llm_batch.core.config import get_settings
from llm_batch.core.jobs import JobStatus
from llm_batch.core.layout import JobLayout
from llm_batch.infra.progress import read_progress
from llm_batch.infra.results import count_results
from llm_batch.pipeline import steps
from llm_batch.runtime.warm_engines import Slot, engine_key, stop_hosts
from tests.dags.test_batch_inference import (
    KILL_POLL_S,
    TINY_MODEL,
    _assert_every_request_once,
    _progress_done,
    _request,
    _run,
    _wait_for,
    _write_input,
    hold_shards,
)

pytestmark = [pytest.mark.airflow, pytest.mark.engine]

# Both jobs' configuration, so they share an engine (the second job's shard holds at the
# worker's hold point for its kill).
CONF = {"model": TINY_MODEL, "model_config": {"engine_args": {"max_num_seqs": 8}}}


@pytest.fixture
def warm(llm_batch_home):
    """The home's warm engines. The hosts this test starts (and a killed one's leftovers) are
    stopped after it; the session's hosts of other configurations stay warm for their tests."""
    assert get_settings().warm_engines
    engines = llm_batch_home / "engines"
    before = {f.name: f.read_text() for f in engines.glob("*.pid")}
    yield engines
    started = {f.stem.rpartition("-")[0] for f in engines.glob("*.pid") if before.get(f.name) != f.read_text()}
    for key in started:
        stop_hosts(llm_batch_home, key=key)


def _host_pids(engines, key: str) -> set[int]:
    """The live hosts of the configuration ``key`` (its slots' pid files; a killed host leaves
    its file behind when no new host takes its slot; a zombie is dead)."""

    def alive(pid: int) -> bool:
        try:
            return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    return {pid for f in engines.glob(f"{key}-*.pid") if alive(pid := int(f.read_text()))}


def test_jobs_share_a_warm_engine_and_survive_its_kill(batch_dag, store, tiny_model_dir, llm_batch_home, warm):
    first = _write_input(llm_batch_home, "warm_small", [_request(i) for i in range(6)])
    run = _run(batch_dag, {"job_id": "job_warm_a", "input_uri": first, "data_parallelism": 2, **CONF})
    job = store.get_job("job_warm_a")
    assert run.state == "success" and job.status == JobStatus.SUCCEEDED, job.status_reason
    _assert_every_request_once(JobLayout(get_settings().work_uri, job.id), job, 6)
    key = engine_key(steps.engine_model_config(store, job, get_settings()))
    hosts = _host_pids(warm, key)
    assert len(hosts) >= 1, "no warm engine is running after the job"
    # prepare started the engine (cold: this configuration is this test's) before a shard asked.
    log = Slot(llm_batch_home, key, 0).log.read_text()
    assert "preloaded" in log and "already loaded" in log, log[-3000:]

    n = 60
    second = _write_input(llm_batch_home, "warm_killed", [_request(i, max_tokens=16, min_tokens=16) for i in range(n)])
    layout = JobLayout(get_settings().work_uri, "job_warm_b")
    hold_shards(layout, 20)  # the kill lands mid-shard by construction, those 20 checkpointed
    killed: list[int] = []

    def kill_mid_shard() -> None:
        _wait_for(lambda: _progress_done(layout.shard(0).progress) >= 20, 900, "the shard held", poll=KILL_POLL_S)
        serving = _host_pids(warm, key)
        for pid in serving:
            os.killpg(pid, signal.SIGKILL)
            killed.append(pid)
        assert count_results(layout.shard(0).results) < n, "the shard ended before the kill"
        assert serving & hosts, f"job B did not run on job A's engine ({serving} vs {hosts})"

    run = _run(batch_dag, {"job_id": "job_warm_b", "input_uri": second, **CONF}, during=kill_mid_shard)
    job = store.get_job("job_warm_b")
    assert job.status == JobStatus.SUCCEEDED, job.status_reason
    _assert_every_request_once(layout, job, n)
    assert read_progress(layout.shard(0).progress).resumed > 0, "the retry did not resume from the checkpoint"
    tries = [ti.try_number for ti in run.get_task_instances() if ti.task_id.startswith("run_shard") and ti.map_index >= 0]
    assert len(tries) == 1 and tries[0] >= 2
    assert killed and not (_host_pids(warm, key) & set(killed)), "the retry ran on a killed engine"
