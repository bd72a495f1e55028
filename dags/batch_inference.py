"""### batch_inference: one batch job per run

`prepare -> run_shard (mapped: one task instance per shard) -> finalize`

`prepare` registers the job, validates its input and plans its shards; `finalize` merges the
shards' results in input order and ends the job (one task each: a task's start costs more
than a small job's steps).

Trigger it from the form, from `POST /api/v2/dags/batch_inference/dagRuns` (conf = the params
below) or from the batch REST API. Every run is a job in llm-batch's job store and ends it in
a terminal status with a reason; the steps live in `llm_batch.pipeline.steps`.

A succeeded job emits one event on `llm-batch://results` (its `extra`: job id, status, counts,
labels, output URIs) and one through the alias `llm-batch-results` on its result file; its
other assets get theirs through `llm-batch-more-results`. A FAILED or TIMEOUT_EXCEEDED job
fails the run; a CANCELLED job's run ends success (a cancel is a decision, not a failure).
"""

from __future__ import annotations

import copy
from datetime import datetime, timedelta
from typing import Any

from airflow.sdk import DAG, Asset, AssetAlias, Param, get_current_context, task
from airflow.sdk.exceptions import AirflowFailException, AirflowSkipException

from llm_batch.airflow import lanes
from llm_batch.airflow import users as airflow_users
from llm_batch.airflow.operators import shard_operator
from llm_batch.airflow.operators.local import warm_early
from llm_batch.core import jobs, run_conf
from llm_batch.core.config import get_settings
from llm_batch.core.job_spec import KUBERNETES_ONLY, JobOptions, JobSpec, field_schemas
from llm_batch.core.run_conf import SHARD_TASK_ID
from llm_batch.infra.log_context import bind_job
from llm_batch.pipeline import steps

SETTINGS = get_settings()
# One event per completed batch through the first alias; its other assets through the second.
RESULTS_ALIAS = "llm-batch-results"
MORE_RESULTS_ALIAS = "llm-batch-more-results"
MODELS = steps.registry_model_names(SETTINGS)

# The form's own choices beyond the spec's: the registry's models, the server's deadline.
FORM_DEFAULTS = {
    "model": {"default": run_conf.DEFAULT_MODEL, **({"enum": MODELS} if run_conf.DEFAULT_MODEL in MODELS else {})},
    "max_runtime_sec": {"default": SETTINGS.default_max_runtime_sec},
}
# The JSON-schema keywords a form field keeps (nested objects' own schemas are admission's to check).
_KEPT = ("enum", "minimum", "maximum", "exclusiveMinimum", "maxLength", "pattern", "items")


def form_params() -> dict[str, Param]:
    """The form: a Param of each ``RunConf`` field's JSON schema (a local runner's without the
    Kubernetes-only fields)."""
    schemas = field_schemas(run_conf.RunConf)
    options = list(JobOptions.model_fields)
    names = [*(n for n in run_conf.RunConf.model_fields if n not in JobSpec.model_fields and n != "owner"),
             *(n for n in JobSpec.model_fields if n not in options), *options]
    params = {}
    for name in names:
        field = run_conf.RunConf.model_fields[name]
        key = field.alias or name
        if SETTINGS.shard_runner == "local" and key in KUBERNETES_ONLY:
            continue
        schema = schemas[key] | FORM_DEFAULTS.get(key, {})
        default = schema.get("default", None if field.default_factory is None else field.default_factory())
        types = schema["type"]
        params[key] = Param(default, type=types[0] if len(types) == 1 else types, description=schema["description"],
                            **{k: schema[k] for k in _KEPT if k in schema})
    return params


PARAMS = form_params()

# A run's conf is merged over these, not over context["params"] (dag.test carries those over).
DEFAULTS = {name: copy.deepcopy(param.value) for name, param in PARAMS.items()}

ShardOperator = shard_operator(SETTINGS.shard_runner)


def _store():
    from llm_batch.infra.jobstore import get_job_store  # heavy

    return get_job_store(SETTINGS.database_url)


def _job_id_of(context: Any) -> str:
    dag_run = context["dag_run"]
    return run_conf.run_job_id(dag_run.conf or {}, dag_run.run_id)


def _end_job_of_failed_run(context: Any) -> None:
    """The run failed (a task failed for good, or dagrun_timeout): the job must not stay live."""
    reason = context.get("reason") or "a task failed"
    steps.fail_job(_store(), _job_id_of(context), f"the DAG run ended without finishing the job: {reason}",
                   dag_run_id=context["dag_run"].run_id)


# prepare's XComs: the job it registered (before validation), or why it refused the run.
JOB_ID_KEY = "job_id"
REFUSED_KEY = "refused"


def _registered_job_id() -> str:
    """The job prepare registered; none: fail for good with prepare's reason."""
    ti = get_current_context()["ti"]
    job_id = ti.xcom_pull(task_ids="prepare", key=JOB_ID_KEY)
    if job_id is None:
        why = ti.xcom_pull(task_ids="prepare", key=REFUSED_KEY)
        raise AirflowFailException(f"the run was refused: {why or 'see the prepare log'}")
    return job_id


def _emit_results(job: Any) -> None:
    """The job's result file's event through RESULTS_ALIAS, the others through MORE_RESULTS_ALIAS."""
    outlet_events = get_current_context()["outlet_events"]
    extra = {"job_id": job.id, "status": job.status.value, "total": job.total, "succeeded": job.succeeded,
             "failed": job.failed, "labels": {str(k): str(v) for k, v in (job.labels or {}).items()},
             "output_uri": job.output_uri, "array_output_uri": job.array_output_uri}
    uris = steps.result_asset_uris(job)
    for n, uri in enumerate(uris):
        alias = AssetAlias(RESULTS_ALIAS if n == 0 else MORE_RESULTS_ALIAS)
        outlet_events[alias].add(Asset(uri=uri), extra=extra)
    # Not a declared outlet: that would get an event when a cancelled job's finalize succeeds.
    outlet_events[AssetAlias(MORE_RESULTS_ALIAS)].add(Asset(uri=run_conf.RESULTS_ASSET_URI), extra=extra)


with DAG(
    dag_id=run_conf.BATCH_DAG_ID,
    description="Batch LLM inference: validate, shard, run on vLLM, merge in input order",
    schedule=None,
    start_date=datetime(2025, 1, 1),
    catchup=False,
    params=PARAMS,
    # The backstop: workers stop at the job's own deadline; this ends a run stuck anyway.
    dagrun_timeout=timedelta(seconds=run_conf.MAX_RUNTIME_SEC + 2 * SETTINGS.cancel_grace_seconds + 3600),
    on_failure_callback=_end_job_of_failed_run,
    default_args={"retries": 0, "owner": "llm-batch"},
    max_active_tasks=64,
    tags=["llm-batch"],
    doc_md=__doc__,
) as dag:

    @task(retries=2, retry_delay=timedelta(seconds=5))
    def prepare() -> list[dict[str, Any]]:
        """register -> validate -> plan: the job's shards, as ids and counts."""
        context = get_current_context()
        dag_run, ti = context["dag_run"], context["ti"]
        store = _store()
        try:
            given = dag_run.conf or {}
            owner, trusted = steps.run_owner(getattr(dag_run, "triggering_user_name", None), given,
                                             airflow_users.is_admin)
            conf = DEFAULTS | given | {"owner": owner}
            job_id = steps.register(store, SETTINGS, conf, dag_run.run_id, trusted=trusted)
        except jobs.JobRejected as exc:
            ti.xcom_push(key=REFUSED_KEY, value=str(exc))  # finalize repeats it
            raise AirflowFailException(str(exc)) from exc
        ti.xcom_push(key=JOB_ID_KEY, value=job_id)
        bind_job(job_id)  # every line logged from here on carries it
        try:
            steps.validate(store, SETTINGS, job_id)
        except jobs.JobRejected as exc:
            raise AirflowFailException(str(exc)) from exc
        warming = warm_early(store, SETTINGS, job_id)  # a cold engine starts while the shards are planned
        shards = [steps.shard_ref(shard) for shard in steps.plan(store, SETTINGS, job_id)]
        if warming is not None:
            warming.join()
        return shards

    @task(trigger_rule="all_done", retries=2, retry_delay=timedelta(seconds=5),
          outlets=[AssetAlias(RESULTS_ALIAS), AssetAlias(MORE_RESULTS_ALIAS)])
    def finalize() -> str:
        """merge -> finalize: the outputs in input order, then the job's terminal status."""
        job_id = _registered_job_id()
        bind_job(job_id)
        store = _store()
        steps.merge(store, SETTINGS, job_id)
        job = steps.finalize(store, SETTINGS, job_id)
        summary = steps.job_summary(job)
        if job.status == jobs.JobStatus.FAILED:
            raise AirflowFailException(f"job {job_id} failed: {job.status_reason}")
        if job.status == jobs.JobStatus.CANCELLED:
            # A cancel is not a failure: finalize ends skipped, the run success, no results event.
            raise AirflowSkipException(f"job {job_id}: {summary}")
        if job.status == jobs.JobStatus.TIMEOUT_EXCEEDED:
            # Partial results are kept (and served), but the run must not look like a success.
            raise AirflowFailException(f"job {job_id} ended {job.status.value}: {summary}")
        _emit_results(job)
        print(f"job {job_id}: {summary}")
        return job.status.value

    planned = prepare()
    lane = lanes.default_lane(SETTINGS)  # each task instance gets its run's (shard_routing)
    shards = ShardOperator.partial(
        task_id=SHARD_TASK_ID,
        pool=lane.pool,
        priority_weight=lane.priority_weight,
        weight_rule="absolute",
        retries=SETTINGS.shard_retries,
        retry_delay=timedelta(seconds=SETTINGS.shard_retry_delay_seconds),
    ).expand(shard_task=planned)
    shards >> finalize()
