"""### on_batch_done: runs when a batch completes (an example consumer of batch results)

`batch_inference`'s finalize emits one event on the asset `llm-batch://results` per job that
succeeded, its `extra` holding the job id, status, counts, labels and output URIs. This DAG is
scheduled on that asset and reads the events behind each run (Airflow may put several into
one); it sees only batches completed since Airflow first parsed it. Start from it for
post-processing. New DAGs start paused. A recurring spec's own asset and the alias
`llm-batch-results` work the same way (docs/orchestration.md says when to use which).
"""

from __future__ import annotations

from datetime import datetime

from airflow.sdk import DAG, Asset, get_current_context, task

RESULTS = Asset("llm-batch://results")  # one event per completed batch (dags/batch_inference.py)

with DAG(
    dag_id="llm_batch_on_batch_done",
    description="Example: runs when an llm-batch batch completes",
    schedule=RESULTS,
    start_date=datetime(2025, 1, 1),
    catchup=False,
    is_paused_upon_creation=True,
    tags=["llm-batch", "example"],
    doc_md=__doc__,
) as dag:

    @task
    def report_batches() -> list[dict]:
        """The completed batches behind this run: one dict per asset event."""
        # Read the asset's own events: Airflow lists an event made through an alias under
        # that alias too, so iterating every key would see each batch twice.
        events = get_current_context()["triggering_asset_events"][RESULTS]
        done = []
        for event in events:
            extra = dict(event.extra or {})
            print(f"batch {extra.get('job_id')} done: {extra.get('succeeded')}/{extra.get('total')} "
                  f"succeeded, output {extra.get('output_uri')}")
            done.append({"uri": extra.get("output_uri"), **extra})
        return done

    report_batches()
