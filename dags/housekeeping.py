"""### llm_batch_housekeeping: keep the job store honest

Every 10 minutes:
- **expire**: live jobs past their `expires_at` become TIMEOUT_EXCEEDED (their workers stop
  at that deadline on their own; this catches runs that never got that far);
- **reconcile**: live jobs whose `batch_inference` run ended without finalizing them are
  merged and finalized, or failed with the reason;
- **retention**: files older than `LLM_BATCH_RETENTION_DAYS` or past their own `expires_at`
  are deleted, as are idempotency keys older than 24 hours and expired result cache entries.

The steps are `llm_batch.pipeline.housekeeping`'s; run states come from Airflow's Execution API.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from airflow.sdk import DAG, task
from airflow.sdk.execution_time.task_runner import RuntimeTaskInstance

from llm_batch.core import run_conf
from llm_batch.core.config import get_settings
from llm_batch.pipeline import housekeeping, result_cache

SETTINGS = get_settings()


def _store():
    from llm_batch.infra.jobstore import get_job_store  # heavy

    return get_job_store(SETTINGS.database_url)


with DAG(
    dag_id=run_conf.HOUSEKEEPING_DAG_ID,
    description="Expire, reconcile and clean up llm-batch jobs and files",
    schedule=timedelta(minutes=10),
    start_date=datetime(2025, 1, 1),
    catchup=False,
    max_active_runs=1,
    default_args={"owner": "llm-batch", "retries": 1, "retry_delay": timedelta(minutes=1)},
    tags=["llm-batch"],
    doc_md=__doc__,
) as dag:

    @task
    def expire() -> list[str]:
        return housekeeping.expire(_store(), SETTINGS)

    @task
    def reconcile() -> list[str]:
        store = _store()
        states = {}
        for job in housekeeping.live_jobs(store):
            if job.dag_run_id:
                try:
                    state = RuntimeTaskInstance.get_dagrun_state(run_conf.BATCH_DAG_ID, job.dag_run_id)
                    states[job.dag_run_id] = getattr(state, "value", state)
                except Exception:  # noqa: BLE001 - an unknown run is left for a later round
                    continue
        return housekeeping.reconcile(store, SETTINGS, states)

    @task
    def retention() -> int:
        store = _store()
        housekeeping.delete_old_idempotency_keys(store)  # kept 24 hours
        result_cache.evict(store, SETTINGS)  # entries past their age, then beyond the size bound
        expired = housekeeping.delete_files_past_expiry(store)  # files' own expires_at
        return len(housekeeping.delete_expired_files(store, SETTINGS)) + len(expired)

    expire() >> reconcile() >> retention()
