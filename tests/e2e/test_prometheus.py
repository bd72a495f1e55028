"""A real Prometheus (Debian's, which scripts/test.sh installs) scrapes the real stack's
/batch/metrics with the shipped alert rules: the rules load, the figures move while a job
runs, and a stuck job trips LLMBatchJobStuck (the stack's threshold is 20 s here:
LLM_BATCH_ALERT_JOB_STUCK_S in tests/e2e/conftest.py). The rules' hold time (`for`) is a
parameter of the rules the test loads (HOLD, instead of the shipped minutes): promtool's unit
tests (tests/unit/test_monitoring.py) check the shipped values.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e.conftest import FEW_SEQS, MODEL, hold_shards, long_batch, release_shards, wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.engine, pytest.mark.airflow]

RULES = Path(__file__).resolve().parents[2] / "deploy" / "monitoring" / "alerts.yml"
REQUESTS = 12
HOLD = "4s"  # each rule's `for` here; the shipped rules' own are checked by promtool


def rules_held_for(hold: str, folder: Path) -> Path:
    """The shipped rules with every `for` set to ``hold``: the rules file this test loads."""
    import yaml

    rules = yaml.safe_load(RULES.read_text())
    for group in rules["groups"]:
        for rule in group["rules"]:
            if "for" in rule:
                rule["for"] = hold
    held = folder / "alerts.yml"
    held.write_text(yaml.safe_dump(rules, sort_keys=False))
    return held


@pytest.fixture
def prometheus(e2e_stack, tmp_path: Path) -> Iterator[str]:
    """Prometheus scraping the stack every 2 s (the CLI's admin key as its bearer token) and
    evaluating the rules every 2 s; its HTTP API's URL."""
    from llm_batch.devstack.stack import free_port

    binary = shutil.which("prometheus")
    if not binary:
        pytest.fail("prometheus is missing: scripts/test.sh installs it (apt-get install prometheus)")
    port = free_port()
    config = tmp_path / "prometheus.yml"
    config.write_text(
        "global: {scrape_interval: 2s, evaluation_interval: 2s}\n"
        f"rule_files: ['{rules_held_for(HOLD, tmp_path)}']\n"
        "scrape_configs:\n"
        "  - job_name: llm-batch\n"
        "    metrics_path: /batch/metrics\n"
        f"    authorization: {{credentials: '{e2e_stack.ensure_api_key()}'}}\n"
        f"    static_configs: [{{targets: ['127.0.0.1:{e2e_stack.port}']}}]\n"
    )
    log = open(tmp_path / "prometheus.log", "wb")  # noqa: SIM115 (closed below)
    server = subprocess.Popen([binary, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'data'}",
                               f"--web.listen-address=127.0.0.1:{port}"], stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until("prometheus ready", lambda: _ok(f"{url}/-/ready"), 60, poll=0.5)
        yield url
    finally:
        server.terminate()
        server.wait(timeout=30)
        log.close()
        print((tmp_path / "prometheus.log").read_text()[-3000:])


def _ok(url: str) -> bool:
    try:
        return httpx.get(url, timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def _query(url: str, expr: str) -> list[dict[str, Any]]:
    answer = httpx.get(f"{url}/api/v1/query", params={"query": expr}, timeout=10).json()
    assert answer["status"] == "success", answer
    return answer["data"]["result"]


def _value(url: str, expr: str) -> float | None:
    result = _query(url, expr)
    return float(result[0]["value"][1]) if result else None


def test_prometheus_scrapes_the_stack_sees_a_job_move_and_a_stuck_job_alert(e2e_stack, batch_client, job_logs,
                                                                             prometheus, tmp_path):
    from llm_batch.infra.jobstore import get_job_store

    wait_until("the first scrape", lambda: _value(prometheus, 'up{job="llm-batch"}') == 1, 60)
    rules = httpx.get(f"{prometheus}/api/v1/rules", timeout=10).json()["data"]["groups"]
    assert sorted(r["name"] for g in rules for r in g["rules"]) == sorted([
        "LLMBatchApiErrors", "LLMBatchFailureRate", "LLMBatchJobStuck", "LLMBatchNoScheduler",
        "LLMBatchQueueTooOld", "LLMBatchWebhookBacklog"])

    # A job no run drives: RUNNING, never moving (as a job whose worker hangs looks).
    store = get_job_store(e2e_stack.settings.database_url)
    stuck = store.create_job(dialect="openai", endpoint="/v1/chat/completions", model=MODEL, owner="admin",
                             labels={"test": "stuck"})
    store.transition(stuck.id, "VALIDATING")
    store.transition(stuck.id, "RUNNING")
    try:
        before = _value(prometheus, 'llm_batch_requests{outcome="succeeded"}') or 0.0
        # The shard holds after 3 results (the worker's hold point): the job is seen running,
        # with its first results counted, between scrapes, whatever the machine's speed.
        job = batch_client.submit(long_batch(tmp_path / "metrics.jsonl", REQUESTS, first_tokens=16, step=1),
                                  endpoint="/v1/chat/completions", model=MODEL,
                                  model_config=FEW_SEQS, new=True)
        hold_shards(job.id, 3)
        job_logs.append(job.id)
        # While it runs: its throughput shows, and its results count up before it ends.
        wait_until("a running job with throughput", lambda: (_value(
            prometheus, f'sum(llm_batch_tokens_per_second{{model="{MODEL}"}})') or 0) > 0, 600, poll=1)
        seen = wait_until("results counted while it runs", lambda: (v := (_value(
            prometheus, 'llm_batch_requests{outcome="succeeded"}') or 0) - before) > 0 and v, 120, poll=1)
        assert batch_client.job(job.id).status == "RUNNING" and seen < REQUESTS
        release_shards(job.id)
        done = batch_client.wait(job.id, timeout=600)
        assert done.status == "SUCCEEDED"
        wait_until("every result counted", lambda: (_value(
            prometheus, 'llm_batch_requests{outcome="succeeded"}') or 0) - before == REQUESTS, 60, poll=1)
        # Correlation: the job's task logs (JSON lines) carry its id as a field, from the
        # prepare, shard and finalize tasks alike, and the worker's own lines name it too.
        run_id = batch_client.get_job(job.id)["dag_run_id"]
        carried: dict[str, int] = {}
        for log in e2e_stack.log_dir.glob(f"dag_id=batch_inference/run_id={run_id}/task_id=*/**/*.log"):
            task = log.parts[-2] if log.parts[-2].startswith("task_id=") else log.parts[-3]
            lines = [json.loads(line) for line in log.read_text().splitlines() if line.startswith("{")]
            carried[task] = carried.get(task, 0) + sum(line.get("job_id") == job.id for line in lines)
            assert not [line for line in lines if line.get("job_id") not in (None, job.id)]
        assert all(carried.get(f"task_id={t}", 0) > 0 for t in ("prepare", "run_shard", "finalize")), carried
        shard_log = "".join(log.read_text() for log in e2e_stack.log_dir.glob(
            f"dag_id=batch_inference/run_id={run_id}/task_id=run_shard/**/*.log"))
        assert f"[job {job.id}]" in shard_log  # the worker process's plain lines
        assert (_value(prometheus, 'max(llm_batch_api_requests_total{route="/v1/jobs/{job_id}",code="200"})') or 0) > 0

        def stuck_alert() -> dict[str, Any] | None:
            alerts = httpx.get(f"{prometheus}/api/v1/alerts", timeout=10).json()["data"]["alerts"]
            return next((a for a in alerts if a["labels"]["alertname"] == "LLMBatchJobStuck"
                         and a["state"] == "firing"), None)

        started = time.monotonic()
        fired = wait_until("LLMBatchJobStuck to fire", stuck_alert, 180, poll=2)
        assert fired["labels"]["status"] == "RUNNING", fired
        print(f"LLMBatchJobStuck fired {time.monotonic() - started:.0f} s after the job ended")
        # Nothing else is wrong with the stack: no other alert fires.
        others = [a["labels"]["alertname"] for a in httpx.get(f"{prometheus}/api/v1/alerts", timeout=10).json()["data"]["alerts"]
                  if a["state"] == "firing" and a["labels"]["alertname"] != "LLMBatchJobStuck"]
        assert others == [], others
    finally:
        store.end_job(stuck.id, "CANCELLED", "the test's stuck job, ended")
