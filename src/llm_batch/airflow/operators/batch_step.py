"""``LLMBatchOperator``: a batch of LLM requests as one step of your own DAG (docs/orchestration.md,
"A batch as a step of your DAG"). The job id derives from the task instance, so a retried try
re-attaches to its job."""

from __future__ import annotations

import hashlib
import hmac
import time
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

from airflow.sdk import Asset, AssetAlias, BaseOperator
from airflow.sdk.exceptions import AirflowException, AirflowFailException, AirflowSkipException

from llm_batch.airflow.hooks.llm_batch import LLMBatchApiError, LLMBatchHook, base_url_of
from llm_batch.airflow.triggers.batch_job import BatchJobTrigger
from llm_batch.core.job_spec import JobSpec

MANIFEST_SCHEMA_VERSION = 1
INPUTS = ("prompts", "requests", "input_uri", "input_file_ids")
# The spec's fields the operator does not name itself (templated ones): taken as they are.
SPEC_ARGUMENTS = [name for name in JobSpec.model_fields
                  if name not in ("model", "endpoint", "engine_config", "labels", "output_uri")]


def step_job_id(dag_id: str, run_id: str, task_id: str, map_index: int | None, secret: str = "") -> str:
    """The job id of one task instance (every try the same), keyed by ``secret`` (the API key)
    so that no other owner can take a future run's id first."""
    key = "\x1f".join([dag_id, run_id, task_id, str(-1 if map_index is None else map_index)])
    return "af-" + hmac.new(secret.encode(), key.encode(), hashlib.sha256).hexdigest()[:32]


def chat_requests(prompts: Sequence[Any], system_prompt: str | None, request_params: dict[str, Any]) -> list[Any]:
    """Prompts as chat requests (custom_id: the index); a non-string is passed on for the API to refuse."""
    made: list[Any] = []
    for index, prompt in enumerate(prompts):
        if not isinstance(prompt, str):
            made.append(prompt)
            continue
        messages = ([{"role": "system", "content": system_prompt}] if system_prompt else []) + [
            {"role": "user", "content": prompt}
        ]
        made.append({"custom_id": str(index), "body": {**request_params, "messages": messages}})
    return made


def as_requests(items: Sequence[Any]) -> list[Any]:
    """``requests`` as the API takes them: a bare body gets its position as custom_id."""
    return [{"custom_id": str(index), "body": item}
            if isinstance(item, dict) and "body" not in item and "custom_id" not in item else item
            for index, item in enumerate(items)]


STEP_RESULTS_ALIAS = "llm-batch-step-results"


def step_asset_uri(dag_id: str, task_id: str) -> str:
    """The asset a finished LLMBatchOperator step updates (one per DAG and task)."""
    return f"llm-batch://steps/{dag_id}/{task_id}"


def manifest_of(job: dict[str, Any], base_url: str | None = None) -> dict[str, Any]:
    """The task's XCom: where the results are and how many requests landed where (common-ai's
    buckets; every request of an ended job is ``succeeded`` or ``errored``)."""
    counts = job.get("counts") or {}
    total, succeeded, failed = counts.get("total", 0), counts.get("succeeded", 0), counts.get("failed", 0)

    def content_uri(file_id: str | None) -> str | None:
        return f"{base_url}/v1/files/{file_id}/content" if file_id and base_url else None

    return {
        "schema_version": MANIFEST_SCHEMA_VERSION,
        "job_id": job["id"],
        "status": job["status"],
        "status_reason": job.get("status_reason"),
        "dag_run_id": job.get("dag_run_id"),
        "request_count": total,
        "succeeded": succeeded,
        "errored": failed,
        "expired": 0,
        "cancelled": 0,
        "missing": max(total - succeeded - failed, 0),
        # of the succeeded: answered from the owner's result cache (no engine time)
        "cached": int((job.get("usage") or {}).get("cached_requests") or 0),
        # of the errored: answers that failed the job's output_check after its tries
        "invalid_output": int(counts.get("invalid_output") or 0),
        "output_file_id": job.get("output_file_id"),
        "error_file_id": job.get("error_file_id"),
        "output_uri": job.get("output_uri"),
        "result_uri": job.get("output_uri") or content_uri(job.get("output_file_id")),
        "error_uri": content_uri(job.get("error_file_id")),
        "usage": job.get("usage") or {},
    }


class LLMBatchOperator(BaseOperator):
    """Run a batch of LLM requests on llm-batch and wait for it (deferrable). Give exactly one
    of ``prompts``, ``requests``, ``input_uri``, ``input_file_ids``; any field of the job's spec
    (``llm_batch.core.job_spec.JobSpec``) is an argument too, sent as given. The parameters are
    in docs/orchestration.md."""

    template_fields: Sequence[str] = (
        "prompts",
        "requests",
        "input_uri",
        "input_file_ids",
        "model",
        "request_params",
        "model_config",
        "labels",
        "output_uri",
    )
    template_fields_renderers = {"requests": "json", "model_config": "json", "labels": "json", "request_params": "json"}
    ui_color = "#e8f4ea"

    def __init__(
        self,
        *,
        model: str,
        prompts: list[str] | None = None,
        requests: list[Any] | None = None,
        input_uri: str | None = None,
        input_file_ids: list[str] | None = None,
        endpoint: str = "/v1/chat/completions",
        system_prompt: str | None = None,
        request_params: dict[str, Any] | None = None,
        model_config: dict[str, Any] | None = None,
        labels: dict[str, str] | None = None,
        output_uri: str | None = None,
        llm_batch_conn_id: str = LLMBatchHook.default_conn_name,
        deferrable: bool = True,
        poll_interval: float = 10.0,
        cancel_on_kill: bool = True,
        cancel_on_timeout: bool = True,
        max_failed_fraction: float = 0.0,
        **kwargs: Any,
    ) -> None:
        kwargs.setdefault("outlets", [AssetAlias(STEP_RESULTS_ALIAS)])
        # A retry attaches to the same job: it rides over a lost API call and over Airflow
        # failing a resumed deferred try on a stale event (apache/airflow#72716).
        kwargs.setdefault("retries", 2)
        kwargs.setdefault("retry_delay", timedelta(seconds=5))
        self.spec = {name: kwargs.pop(name) for name in SPEC_ARGUMENTS if name in kwargs}
        super().__init__(**kwargs)
        if not 0.0 <= max_failed_fraction <= 1.0:
            raise ValueError(f"max_failed_fraction must be between 0 and 1, got {max_failed_fraction}")
        self.model = model
        self.prompts = prompts
        self.requests = requests
        self.input_uri = input_uri
        self.input_file_ids = input_file_ids
        self.endpoint = endpoint
        self.system_prompt = system_prompt
        self.request_params = request_params or {}
        self.model_config = model_config or {}
        self.labels = labels or {}
        self.output_uri = output_uri
        self.llm_batch_conn_id = llm_batch_conn_id
        self.deferrable = deferrable
        self.poll_interval = poll_interval
        self.cancel_on_kill = cancel_on_kill
        self.cancel_on_timeout = cancel_on_timeout
        self.max_failed_fraction = max_failed_fraction
        self.job_id: str | None = None

    @property
    def hook(self) -> LLMBatchHook:
        return LLMBatchHook(llm_batch_conn_id=self.llm_batch_conn_id)

    # -- the request ----------------------------------------------------------------------

    def job_body(self, job_id: str) -> dict[str, Any]:
        """The ``POST /v1/jobs`` body; exactly one input (ValueError otherwise)."""
        given = [name for name in INPUTS if getattr(self, name) not in (None, [], "")]
        if len(given) != 1:
            raise ValueError(f"give exactly one of {', '.join(INPUTS)}; got {', '.join(given) or 'none'}")
        body: dict[str, Any] = {
            **self.spec,
            "id": job_id,
            "model": self.model,
            "endpoint": self.endpoint,
            "model_config": self.model_config,
            "labels": {"llm-batch.io/dag-id": self.dag_id, "llm-batch.io/task-id": self.task_id, **self.labels},
        }
        if self.output_uri is not None:
            body["output_uri"] = self.output_uri
        if self.prompts:
            if isinstance(self.prompts, str):
                raise ValueError("prompts must be a list of strings, got one string")
            body["requests"] = chat_requests(list(self.prompts), self.system_prompt, self.request_params)
        elif self.requests:
            body["requests"] = as_requests(list(self.requests))
        elif self.input_uri:
            body["input_uri"] = self.input_uri
        else:
            body["input_file_ids"] = list(self.input_file_ids or [])
        return body

    # -- execution ------------------------------------------------------------------------

    def execute(self, context: Any) -> dict[str, Any]:
        ti = context["ti"]
        self.job_id = step_job_id(ti.dag_id, ti.run_id, ti.task_id, getattr(ti, "map_index", -1),
                                  self.hook.job_id_secret())
        try:
            job = self.hook.create_job(self.job_body(self.job_id))
        except LLMBatchApiError as exc:
            # A refusal will not pass on a retry: fail now.
            if 400 <= exc.status < 500 and exc.status != 429:
                raise AirflowFailException(str(exc)) from exc
            raise AirflowException(str(exc)) from exc
        self.log.info("llm-batch job %s: %s (run %s)", job["id"], job["status"], job.get("dag_run_id"))
        ti.xcom_push(key="job_id", value=job["id"])
        if job.get("terminal"):
            return self._finish(context, job)
        if self.deferrable:
            end_time = time.time() + self.execution_timeout.total_seconds() if self.execution_timeout else None
            self.defer(
                trigger=BatchJobTrigger(job_id=job["id"], llm_batch_conn_id=self.llm_batch_conn_id,
                                        poll_interval=self.poll_interval, end_time=end_time),
                method_name="execute_complete",
                # The trigger ends the wait itself (so the job can be cancelled): a backstop.
                timeout=self.execution_timeout + timedelta(minutes=5) if self.execution_timeout else None,
            )
        return self._finish(context, self._wait(job["id"]))

    def _wait(self, job_id: str) -> dict[str, Any]:
        while True:
            job = self.hook.get_job(job_id)
            if job.get("terminal"):
                return job
            time.sleep(self.poll_interval)

    def execute_complete(self, context: Any, event: dict[str, Any]) -> dict[str, Any]:
        self.job_id = event.get("job_id")
        if event.get("status") == "ended":
            return self._finish(context, event["job"])
        if event.get("status") == "timeout":
            if self.cancel_on_timeout and self.job_id:
                self._cancel("the wait outlasted execution_timeout")
            raise AirflowException(f"llm-batch job {self.job_id} did not end within execution_timeout")
        raise AirflowException(f"waiting for llm-batch job {self.job_id} failed: {event.get('message')}")

    def _finish(self, context: Any, job: dict[str, Any]) -> dict[str, Any]:
        manifest = manifest_of(job, self._base_url())
        self.log.info("llm-batch job %s ended %s: %s succeeded, %s errored of %s", job["id"], job["status"],
                      manifest["succeeded"], manifest["errored"], manifest["request_count"])
        total = manifest["request_count"]
        failed_fraction = manifest["errored"] / total if total else 0.0
        problem = None
        if job["status"] == "CANCELLED":
            # A cancel is a decision, not a failure: skipped, the partial results' manifest pushed.
            context["ti"].xcom_push(key="manifest", value=manifest)
            raise AirflowSkipException(f"llm-batch job {job['id']} was cancelled: "
                                       f"{job.get('status_reason') or 'no reason given'}")
        if job["status"] != "SUCCEEDED":
            problem = f"llm-batch job {job['id']} ended {job['status']}: {job.get('status_reason') or 'no reason given'}"
        elif failed_fraction > self.max_failed_fraction:
            problem = (f"llm-batch job {job['id']}: {manifest['errored']} of {total} requests failed "
                       f"({failed_fraction:.1%} > max_failed_fraction {self.max_failed_fraction:.1%}); "
                       f"error file {manifest['error_file_id']}")
        if problem is not None:
            context["ti"].xcom_push(key="manifest", value=manifest)
            raise AirflowFailException(problem)  # a retry would attach to this same ended job
        if any(isinstance(o, AssetAlias) and o.name == STEP_RESULTS_ALIAS for o in self.outlets):
            uri = step_asset_uri(self.dag_id, self.task_id)
            context["outlet_events"][AssetAlias(STEP_RESULTS_ALIAS)].add(Asset(uri=uri), extra=manifest)
        return manifest

    def _base_url(self) -> str | None:
        try:
            return base_url_of(self.hook.get_connection(self.llm_batch_conn_id))
        except Exception:  # the manifest's content URIs are a convenience
            return None

    def _cancel(self, why: str) -> None:
        try:
            job = self.hook.cancel_job(self.job_id)  # type: ignore[arg-type]
            self.log.info("cancel of llm-batch job %s requested (%s): now %s", self.job_id, why, job["status"])
        except Exception as exc:  # a failed cancel never hides why the task stops
            self.log.warning("could not cancel llm-batch job %s: %s", self.job_id, exc)

    def on_kill(self) -> None:
        if self.cancel_on_kill and self.job_id:
            self._cancel("the task was killed")
