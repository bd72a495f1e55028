"""``BatchJobTrigger``: waits in the triggerer until an llm-batch job has ended, polling it
through ``LLMBatchHook.aget_job``; its events: ``ended``, ``error`` and ``timeout``."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

from airflow.triggers.base import BaseTrigger, TriggerEvent

from llm_batch.airflow.hooks.llm_batch import LLMBatchApiError, LLMBatchHook


class BatchJobTrigger(BaseTrigger):
    """Poll one job until it ends.

    :param job_id: the job to wait for.
    :param llm_batch_conn_id: the API's Airflow Connection.
    :param poll_interval: seconds between polls.
    :param end_time: Unix time to give up at (a ``timeout`` event); None: never.
    :param max_poll_errors: consecutive failed polls before an ``error`` event.
    """

    def __init__(self, job_id: str, llm_batch_conn_id: str = LLMBatchHook.default_conn_name, poll_interval: float = 10.0,
                 end_time: float | None = None, max_poll_errors: int = 5) -> None:
        super().__init__()
        self.job_id = job_id
        self.llm_batch_conn_id = llm_batch_conn_id
        self.poll_interval = poll_interval
        self.end_time = end_time
        self.max_poll_errors = max_poll_errors

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return f"{__name__}.BatchJobTrigger", {
            "job_id": self.job_id, "llm_batch_conn_id": self.llm_batch_conn_id, "poll_interval": self.poll_interval,
            "end_time": self.end_time, "max_poll_errors": self.max_poll_errors,
        }

    async def run(self) -> AsyncIterator[TriggerEvent]:
        hook = LLMBatchHook(llm_batch_conn_id=self.llm_batch_conn_id)
        errors = 0
        job: dict[str, Any] | None = None
        while True:
            try:
                job = await hook.aget_job(self.job_id)
                errors = 0
            except LLMBatchApiError as exc:  # 401, 403, 404 are not transient: the job is gone or not ours
                errors = self.max_poll_errors if exc.status in (401, 403, 404) else errors + 1
                message = str(exc)
            except Exception as exc:  # network and the like: retried
                errors += 1
                message = f"{type(exc).__name__}: {exc}"
            if errors >= self.max_poll_errors:
                yield TriggerEvent({"status": "error", "job_id": self.job_id, "message": message})
                return
            if job is not None and errors == 0 and job.get("terminal"):
                yield TriggerEvent({"status": "ended", "job_id": self.job_id, "job": job})
                return
            if self.end_time is not None and time.time() >= self.end_time:
                yield TriggerEvent({"status": "timeout", "job_id": self.job_id, "job": job})
                return
            if job is not None and errors == 0:
                self.log.info("job %s is %s (%s/%s requests)", self.job_id, job.get("status"),
                              job.get("counts", {}).get("completed"), job.get("counts", {}).get("total"))
            await asyncio.sleep(self.poll_interval)
