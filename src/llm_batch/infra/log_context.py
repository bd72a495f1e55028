"""The job a log line concerns, on every line of it: ``job_id``, bound to the current context
(context variables: never another request's), through structlog in Airflow's processes and
``JobIdFilter`` on stdlib records elsewhere (the inference image has no structlog)."""

from __future__ import annotations

import logging
from contextvars import ContextVar

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s [job %(job_id)s]: %(message)s"
_JOB: ContextVar[str] = ContextVar("llm_batch_job_id", default="-")


def bind_job(job_id: str) -> None:
    _JOB.set(job_id)
    try:  # structlog: in Airflow's processes only
        import structlog.contextvars  # optional
    except ImportError:
        return
    structlog.contextvars.bind_contextvars(job_id=job_id)


def current_job() -> str:
    return _JOB.get()


class JobIdFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        record.job_id = _JOB.get()
        return True


def configure_plain_logging(level: int = logging.INFO) -> None:
    """The worker processes': each line names its job."""
    logging.basicConfig(level=level, format=LOG_FORMAT)
    for handler in logging.getLogger().handlers:
        handler.addFilter(JobIdFilter())
