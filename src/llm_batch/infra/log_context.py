"""The job a log line concerns, on every line of it: ``job_id``.

``bind_job(job_id)`` marks the current context (a thread, an asyncio task, a request's
thread; context variables, so it never leaks to another request):

- in Airflow's processes (the api-server, task processes) structlog's context variables,
  which Airflow's logging merges into every line, stdlib loggers' included: a ``job_id`` key
  of the structured line (Airflow's UI and its JSON task logs show it);
- everywhere, a context variable of ours that ``JobIdFilter`` puts on stdlib records, so the
  plain format of the processes Airflow does not configure (the worker, ``LOG_FORMAT``)
  prints ``[job <id>]``.

structlog comes with Airflow; the inference image has no Airflow, and needs none of it here.
"""

from __future__ import annotations

import logging
from contextvars import ContextVar

NO_JOB = "-"
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s [job %(job_id)s]: %(message)s"
_JOB: ContextVar[str] = ContextVar("llm_batch_job_id", default=NO_JOB)


def bind_job(job_id: str) -> None:
    """Every log line from here on in this context concerns `job_id`."""
    _JOB.set(job_id)
    try:  # structlog: in Airflow's processes only
        import structlog.contextvars  # optional
    except ImportError:
        return
    structlog.contextvars.bind_contextvars(job_id=job_id)


def current_job() -> str:
    return _JOB.get()


class JobIdFilter(logging.Filter):
    """Puts ``job_id`` (the bound job, else ``-``) on every record a handler sees."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.job_id = _JOB.get()
        return True


def configure_plain_logging(level: int = logging.INFO) -> None:
    """The worker processes' logging: INFO and up to stderr, each line naming its job."""
    logging.basicConfig(level=level, format=LOG_FORMAT)
    for handler in logging.getLogger().handlers:
        handler.addFilter(JobIdFilter())
