"""Every log line about a job carries its id: structlog's context (Airflow's processes merge
it into every line) and the plain format of the worker processes."""

from __future__ import annotations

import contextvars
import io
import logging

from llm_batch.infra.log_context import LOG_FORMAT, JobIdFilter, bind_job, current_job


def _in_fresh_context(fn):
    return contextvars.copy_context().run(fn)  # nothing bound here leaks to other tests


def test_a_worker_line_names_its_job_once_bound():
    def run() -> str:
        stream = io.StringIO()
        handler = logging.StreamHandler(stream)
        handler.setFormatter(logging.Formatter(LOG_FORMAT))
        handler.addFilter(JobIdFilter())
        log = logging.getLogger("llm_batch.test_log_context")
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        try:
            log.info("before")
            bind_job("job_abc")
            log.info("after")
        finally:
            log.removeHandler(handler)
        return stream.getvalue()

    outside = current_job()  # (another test may have bound one in this process: a shard task's)
    before, after = _in_fresh_context(run).splitlines()
    assert before.endswith(f"[job {outside}]: before")
    assert after.endswith("[job job_abc]: after")
    assert current_job() == outside  # the binding stayed in its context


def test_airflow_s_lines_get_it_from_structlog_s_context():
    import structlog.contextvars

    def run() -> dict:
        bind_job("job_xyz")
        return structlog.contextvars.get_contextvars()

    outside = structlog.contextvars.get_contextvars().get("job_id")
    assert _in_fresh_context(run)["job_id"] == "job_xyz"
    assert structlog.contextvars.get_contextvars().get("job_id") == outside
