"""GET /batch/metrics: Prometheus' text format for admins and the metrics token only, figures
read from the store and Airflow's metadata DB at scrape time, request counts per route template."""

from __future__ import annotations

import uuid

import pytest
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.usefixtures("airflow_dags_in_db")


def _families(text: str) -> dict[str, dict[tuple, float]]:
    out: dict[str, dict[tuple, float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, {})[tuple(sorted(sample.labels.items()))] = sample.value
    return out


def _scrape(client, headers) -> dict[str, dict[tuple, float]]:
    got = client.get("/metrics", headers=headers)
    assert got.status_code == 200, got.text
    assert got.headers["content-type"].startswith("text/plain")
    return _families(got.text)


def test_only_admins_and_the_metrics_token_read_metrics(client, creds, batch_api, monkeypatch):
    assert client.get("/metrics").status_code == 401
    assert client.get("/metrics", headers=creds.key("alice")).status_code == 403  # a user's key
    assert client.get("/metrics", headers={"Authorization": "Bearer not-the-token"}).status_code == 401
    settings = batch_api.state.llm_batch.settings
    token = uuid.uuid4().hex * 2
    monkeypatch.setattr(settings, "metrics_token", __import__("pydantic").SecretStr(token))
    assert client.get("/metrics", headers={"Authorization": f"Bearer {token}"}).status_code == 200
    assert client.get("/metrics", headers={"Authorization": f"Bearer {token}x"}).status_code == 401
    assert client.get("/metrics", headers=creds.key("admin-key")).status_code == 200


def test_figures_follow_the_store_and_requests_are_counted_by_template(client, creds, api_store):
    model = f"metrics-model-{uuid.uuid4().hex[:6]}"
    before = _scrape(client, creds.key("admin-key"))
    job = api_store.create_job(dialect="openai", endpoint="/v1/chat/completions", model=model, owner="alice")
    api_store.set_counts(job.id, total=10)
    api_store.transition(job.id, "VALIDATING")
    api_store.transition(job.id, "RUNNING")
    api_store.report_shard(job.id, 0, state="running", total=10, done=4, succeeded=3, failed=1,
                           prompt_tokens=40, completion_tokens=120, engine_seconds=2.0)
    # An ended job's merge figures: 2 lines from the result cache, 1 invalid output after 3 retries.
    ended = api_store.create_job(dialect="openai", endpoint="/v1/chat/completions", model=model, owner="alice")
    api_store.set_usage(ended.id, prompt_tokens=30, completion_tokens=9, cached_prompt_tokens=0, reasoning_tokens=0,
                        result_cache_hits=2, result_cache_tokens=20, invalid_output=1, output_retries=3,
                        retry_tokens=33)
    for _ in range(3):
        assert client.get(f"/v1/jobs/{job.id}", headers=creds.key("alice")).status_code == 200
    assert client.get("/v1/jobs/job_nope", headers=creds.key("alice")).status_code == 404
    after = _scrape(client, creds.key("admin-key"))

    assert after["llm_batch_jobs"][(("model", model), ("status", "RUNNING"))] == 1
    assert after["llm_batch_tokens_per_second"][(("model", model),)] > 0
    for name, added in (("llm_batch_cached_requests", 2), ("llm_batch_invalid_output_requests", 1),
                        ("llm_batch_output_retries", 3)):
        assert after[name][()] - before.get(name, {}).get((), 0) == added, name
    for kind, added in (("prompt", 70), ("completion", 129), ("result_cache", 20), ("retry", 33)):
        key = (("kind", kind),)
        assert after["llm_batch_tokens"][key] - before["llm_batch_tokens"].get(key, 0) == added
    assert after["llm_batch_requests"][(("outcome", "failed"),)] - before["llm_batch_requests"][(("outcome", "failed"),)] == 1
    assert after["llm_batch_live_job_still_seconds"][(("status", "RUNNING"),)] >= 0
    assert after["llm_batch_alert_threshold"][(("alert", "job_stuck_seconds"),)] == 1800
    # Counted under the route's template, never the id a caller sent.
    ok = after["llm_batch_api_requests_total"]
    route = (("code", "200"), ("method", "GET"), ("route", "/v1/jobs/{job_id}"))
    assert ok[route] - before.get("llm_batch_api_requests_total", {}).get(route, 0) == 3
    assert ok[(("code", "404"), ("method", "GET"), ("route", "/v1/jobs/{job_id}"))] >= 1
    assert not [labels for labels in ok if job.id in str(labels)]
    assert "llm_batch_api_request_duration_seconds_bucket" in after
    # Airflow's side: every pool reads, the scheduler's heartbeat age is a number.
    assert (("pool", "(run)"),) in after["llm_batch_queue_jobs"]
    assert "llm_batch_airflow_scheduler_heartbeat_age_seconds" in after
    assert after["llm_batch_webhook_deliveries"][(("status", "pending"),)] >= 0


def test_a_path_no_route_has_is_counted_as_unmatched(client, creds):
    for junk in ("/no/such/route", f"/v1/{uuid.uuid4().hex}/x"):
        assert client.get(junk, headers=creds.key("alice")).status_code == 404
    counted = _scrape(client, creds.key("admin-key"))["llm_batch_api_requests_total"]
    routes = {dict(labels)["route"] for labels in counted}
    assert "(unmatched)" in routes and not [r for r in routes if "no/such" in r]


def test_the_dashboard_and_the_alert_rules_name_only_metrics_the_api_exposes(client, creds):
    """Every metric a Grafana panel or an alert rule queries is one /metrics answers."""
    import json
    import re
    from pathlib import Path

    monitoring = Path(__file__).resolve().parents[2] / "deploy" / "monitoring"
    # Every family the answer declares counts, with samples or not (a store with no running
    # job has no tokens/s sample, an API that has counted no request no duration bucket,
    # whatever ran before this test).
    scraped = client.get("/metrics", headers=creds.key("admin-key")).text
    exposed = set(_families(scraped)) | set(re.findall(r"^# TYPE (llm_batch_[a-z_]+) ", scraped, re.MULTILINE))
    dashboard = json.loads((monitoring / "grafana-dashboard.json").read_text())
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    exprs.append((monitoring / "alerts.yml").read_text())
    named = {m for expr in exprs for m in re.findall(r"\bllm_batch_[a-z_]+", expr)}
    family = {m: re.sub(r"_(bucket|sum|count|total)$", "", m) for m in named}
    assert named and not [m for m in named if m not in exposed and family[m] not in exposed], named - exposed
    assert len(dashboard["panels"]) >= 10 and len({p["id"] for p in dashboard["panels"]}) == len(dashboard["panels"])


def test_failed_requests_of_ended_jobs_are_split_by_why(client, creds, api_store):
    before = _scrape(client, creds.key("admin-key")).get("llm_batch_failed_requests", {})
    job = api_store.create_job(dialect="openai", endpoint="/v1/chat/completions", model="m-split", owner="alice")
    api_store.set_counts(job.id, total=10)
    api_store.transition(job.id, "VALIDATING")
    api_store.transition(job.id, "RUNNING")
    api_store.report_shard(job.id, 0, state="running", total=10, done=10, succeeded=4, failed=6)
    api_store.set_outputs(job.id, errors=[
        {"code": "invalid_request", "message": "input lines failed validation", "count": 1},
        {"code": "not_run", "message": "never run", "count": 3},
        {"code": "request_failed", "message": "requests failed in the engine", "count": 2}])
    api_store.transition(job.id, "FINALIZING")
    api_store.transition(job.id, "SUCCEEDED")
    after = _scrape(client, creds.key("admin-key"))["llm_batch_failed_requests"]
    added = {dict(k)["reason"]: v - before.get(k, 0) for k, v in after.items()}
    assert added == {"invalid": 1, "not_run": 3, "engine": 2}
