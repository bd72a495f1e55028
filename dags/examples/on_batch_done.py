"""### on_batch_done: runs when a batch completes (an example consumer of batch results)

`batch_inference`'s finalize emits an asset event through the alias `llm-batch-results`
for each job that succeeded: the asset is the job's output file, the event's `extra`
holds the job id, status, counts and labels. This DAG is scheduled on that alias; its task
reads the events that triggered it, one per completed batch (Airflow may batch several
into one run). Its first run can also carry earlier batches: Airflow floors a new consumer's
first event window at its oldest asset reference, which a DAG scheduled on an alias does not
have (docs/orchestration.md); filter on `event.timestamp` if that matters. Start from it
for post-processing (load the results somewhere, notify a team). New DAGs start paused:
unpause it to use it. A recurring spec's own asset (`llm-batch://recurring/<name>`)
works the same way for the batches of one spec.
"""

from __future__ import annotations

from datetime import datetime

from airflow.sdk import DAG, AssetAlias, get_current_context, task

RESULTS_ALIAS = "llm-batch-results"  # one event per completed batch (dags/batch_inference.py)

with DAG(
    dag_id="llm_batch_on_batch_done",
    description="Example: runs when an llm-batch batch completes",
    schedule=AssetAlias(RESULTS_ALIAS),
    start_date=datetime(2025, 1, 1),
    catchup=False,
    is_paused_upon_creation=True,
    tags=["llm-batch", "example"],
    doc_md=__doc__,
) as dag:

    @task
    def report_batches() -> list[dict]:
        """The completed batches behind this run: one dict per asset event."""
        # Read the alias's events only: Airflow lists each event under its asset AND under
        # the alias it came through, so iterating every key sees each batch twice.
        events = get_current_context()["triggering_asset_events"][AssetAlias(RESULTS_ALIAS)]
        done = []
        for event in events:
            extra = dict(event.extra or {})
            print(f"batch {extra.get('job_id')} done: {extra.get('succeeded')}/{extra.get('total')} "
                  f"succeeded, output {event.asset.uri}")
            done.append({"uri": event.asset.uri, **extra})
        return done

    report_batches()
