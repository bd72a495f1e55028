"""``GET /batch/metrics``: Prometheus' text format (names and labels: docs/metrics.md).

Figures are read at scrape time from the job store and Airflow's metadata DB, so every replica
answers the same; store sums are gauges, not counters: a deleted job takes its share with it."""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Iterator, Sequence
from datetime import UTC, datetime

from airflow.api_fastapi.common.db.common import SessionDep
from fastapi import APIRouter, Depends, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from sqlalchemy.orm import Session
from starlette.middleware.base import BaseHTTPMiddleware, RequestResponseEndpoint
from starlette.routing import Match

from llm_batch.api.auth import metrics_reader
from llm_batch.api.run_queue import job_places, queue_depths
from llm_batch.api.state import SettingsDep, StoreDep
from llm_batch.core.config import Settings
from llm_batch.core.jobs import JobStatus
from llm_batch.infra.jobstore import JobStore
from llm_batch.pipeline.steps import ERROR_SUMMARY_CODES

router = APIRouter(tags=["metrics"])
LIVE_STATUSES = [s.value for s in JobStatus if not s.terminal]

_REQUESTS = Counter("llm_batch_api_requests", "API requests answered, by route template, method and status code",
                    ["route", "method", "code"])
_LATENCY = Histogram("llm_batch_api_request_duration_seconds", "Time to answer an API request, by route template",
                     ["route", "method"], buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30))


class RequestMetrics(BaseHTTPMiddleware):
    """Counts each answer under its route's template (``/v1/jobs/{job_id}``: a small label set)."""

    async def dispatch(self, request: Request, call_next: RequestResponseEndpoint) -> Response:
        started = time.perf_counter()
        response = await call_next(request)
        route = _template(request)
        _REQUESTS.labels(route, request.method, str(response.status_code)).inc()
        _LATENCY.labels(route, request.method).observe(time.perf_counter() - started)
        return response


def _template(request: Request) -> str:
    for route in request.app.router.routes:
        match, _ = route.matches(request.scope)
        if match == Match.FULL:
            return getattr(route, "path", "(mounted)")
    return "(unmatched)"


def _gauge(name: str, documentation: str, labels: list[str], values: Iterable[tuple[Sequence[str], float]]) -> Metric:
    family = GaugeMetricFamily(name, documentation, labels=labels)
    for label_values, value in values:
        family.add_metric(label_values, value)
    return family


class _Figures(Collector):
    """Reads the store and Airflow's metadata DB once per scrape."""

    def __init__(self, store: JobStore, settings: Settings, session: Session):
        self.store, self.settings, self.session = store, settings, session

    def collect(self) -> Iterator[Metric]:
        figures = self.store.figures()
        yield _gauge("llm_batch_jobs", "Jobs in the store, by status and model", ["status", "model"],
                     sorted(figures.jobs.items()))
        # A job waiting for a pool slot is still by design: only the others can be stuck.
        waiting = job_places(figures.live, self.session)
        stillest: dict[str, float] = {}
        for job in figures.live:
            if job.id not in waiting:
                stillest[job.status] = max(stillest.get(job.status, 0.0), job.still_s)
        yield _gauge("llm_batch_live_job_still_seconds", "Seconds since the stillest live job of each status last "
                     "changed (progress, status), jobs waiting in a queue left out: a stuck job grows it", ["status"],
                     (([status], stillest.get(status, 0.0)) for status in LIVE_STATUSES))
        settings = self.settings
        thresholds = {"job_stuck_seconds": settings.alert_job_stuck_s,
                      "queue_oldest_seconds": settings.alert_queue_oldest_s,
                      "webhook_oldest_pending_seconds": settings.alert_webhook_pending_s,
                      "failed_request_ratio": settings.alert_failed_ratio,
                      "scheduler_heartbeat_age_seconds": settings.alert_scheduler_heartbeat_s}
        yield _gauge("llm_batch_alert_threshold", "The alert rules' thresholds, the server's settings "
                     "(deploy/monitoring/alerts.yml compares against them)", ["alert"],
                     (([alert], value) for alert, value in thresholds.items()))
        yield _gauge("llm_batch_tokens_per_second", "Output tokens per second of the running jobs, by model", ["model"],
                     (([model], value) for model, value in sorted(figures.tokens_per_s.items())))
        u = figures.usage
        yield _gauge("llm_batch_requests", "Requests of the jobs in the store, by outcome (failed: invalid, failed or "
                     "never run)", ["outcome"], [(["succeeded"], u.requests_succeeded),
                                                 (["failed"], u.requests_failed)])
        yield _gauge("llm_batch_failed_requests", "Failed requests of the ended jobs, by why: invalid (validation), "
                     "not_run (cancel, deadline, a failed shard), engine (the engine's error)", ["reason"],
                     (([reason], figures.failed_by_code.get(code, 0)) for reason, code in ERROR_SUMMARY_CODES.items()))
        yield GaugeMetricFamily("llm_batch_cached_requests", "Succeeded requests the result cache answered (no engine "
                                "time; part of llm_batch_requests{outcome=\"succeeded\"})", value=u.cached_requests)
        yield GaugeMetricFamily("llm_batch_invalid_output_requests", "Requests whose answer failed the job's output "
                                "check after its retries (part of llm_batch_requests{outcome=\"failed\"})",
                                value=u.invalid_output)
        yield GaugeMetricFamily("llm_batch_output_retries", "Answers that failed the job's output check and were "
                                "tried again", value=u.output_retries)
        yield _gauge("llm_batch_tokens", "Tokens of the jobs in the store, by kind (cached_prompt, reasoning and "
                     "result_cache are part of prompt and completion; retry is not)", ["kind"],
                     [(["prompt"], u.prompt_tokens), (["completion"], u.completion_tokens),
                      (["cached_prompt"], u.cached_prompt_tokens), (["reasoning"], u.reasoning_tokens),
                      (["result_cache"], u.cached_tokens), (["retry"], u.retry_tokens)])
        yield GaugeMetricFamily("llm_batch_engine_seconds", "Seconds the jobs' engines ran, all attempts", value=u.engine_seconds)
        yield GaugeMetricFamily("llm_batch_gpu_seconds", "Engine seconds x each job's GPUs", value=u.gpu_seconds)
        yield _gauge("llm_batch_webhook_deliveries", "Webhook deliveries by status (pending: the outbox)", ["status"],
                     (([status], figures.deliveries.get(status, 0)) for status in ("pending", "delivered", "failed")))
        yield GaugeMetricFamily("llm_batch_webhook_oldest_pending_seconds", "Age of the oldest pending delivery (0: none)",
                                value=figures.oldest_pending_delivery_s)
        yield _gauge("llm_batch_webhook_attempts", "Webhook delivery attempts, by whether the receiver answered 2xx",
                     ["result"], [(["ok"], figures.attempts.get(True, 0)), (["error"], figures.attempts.get(False, 0))])
        yield from self._airflow()

    def _airflow(self) -> Iterator[Metric]:
        depths = queue_depths(self.session, datetime.now(UTC))
        pools = sorted(depths.pools.items())
        yield _gauge("llm_batch_queue_jobs", "Jobs waiting for a slot of each pool (a run waiting to start at all: "
                     "pool \"(run)\")", ["pool"], (([pool], jobs) for pool, (jobs, _) in pools))
        yield _gauge("llm_batch_queue_oldest_seconds", "Age of the oldest waiting job of each pool, since its "
                     "submission", ["pool"], (([pool], age) for pool, (_, age) in pools))
        yield GaugeMetricFamily("llm_batch_shard_tries", "Tries of every shard task in Airflow's metadata DB",
                                value=depths.shard_tries)
        yield GaugeMetricFamily("llm_batch_shard_retries", "Tries beyond each shard task's first", value=depths.shard_retries)
        yield GaugeMetricFamily("llm_batch_airflow_scheduler_heartbeat_age_seconds", "Seconds since the newest "
                                "heartbeat of a running Airflow scheduler (large: no scheduler)",
                                value=depths.scheduler_heartbeat_age_s)


def _registry(store: JobStore, settings: Settings, session: Session) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Figures(store, settings, session))
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        from prometheus_client import multiprocess  # optional

        multiprocess.MultiProcessCollector(registry)
    else:  # this process's own
        registry.register(_REQUESTS)
        registry.register(_LATENCY)
    return registry


@router.get("/metrics", include_in_schema=False, dependencies=[Depends(metrics_reader)])
def metrics(store: StoreDep, settings: SettingsDep, session: SessionDep) -> Response:
    return Response(generate_latest(_registry(store, settings, session)), media_type=CONTENT_TYPE_LATEST)
