"""### recurring__<name>: one scheduled DAG per recurring batch spec

Each YAML spec in the spec folders (`LLM_BATCH_RECURRING_SPECS` if set; otherwise
`dags/recurring_specs/` and, on the embedded stack, `$LLM_BATCH_HOME/recurring/`) becomes a
DAG whose runs trigger `batch_inference` with the spec's input/output templates rendered for
the run (`llm_batch.pipeline.recurring`). A run whose batch succeeds updates the spec's asset,
`llm-batch://recurring/<name>`, for downstream DAGs to be scheduled on.

A spec that cannot be read stays visible as an import error of this file naming the spec
and the reason; the other specs' DAGs load as usual.
"""

from __future__ import annotations

import os
from datetime import datetime, time
from pathlib import Path

from airflow.providers.standard.operators.trigger_dagrun import TriggerDagRunOperator
from airflow.sdk import DAG, Asset

from llm_batch.core.config import get_settings
from llm_batch.core.run_conf import BATCH_DAG_ID
from llm_batch.pipeline.recurring import DAG_ID_PREFIX, RecurringSpec, RecurringSpecError, load_spec, spec_files

# LLM_BATCH_RECURRING_SPECS overrides; otherwise the repo's examples, then the user's folder
# ($LLM_BATCH_HOME/recurring, passed by the embedded stack): a user's spec of the same name wins.
_USER_SPECS = os.environ.get("LLM_BATCH_USER_RECURRING_SPECS")
SPEC_FOLDERS = (
    [get_settings().recurring_specs] if get_settings().recurring_specs
    else [Path(__file__).parent / "recurring_specs", *([Path(_USER_SPECS)] if _USER_SPECS else [])]
)


class BrokenSpecDag(DAG):
    """Stands for a spec that could not be loaded: its validation fails with the reason, which
    Airflow records as this file's import error, while the good specs' DAGs are bagged."""

    def validate(self) -> None:
        raise RecurringSpecError(self.description)


def _dag_for(spec: RecurringSpec) -> DAG:
    schedule = Asset(spec.schedule.asset) if not isinstance(spec.schedule, str) else spec.schedule
    with DAG(
        dag_id=spec.dag_id,
        description=spec.description or f"recurring batch {spec.name}",
        schedule=schedule,
        start_date=datetime.combine(spec.start_date, time()),
        catchup=False,
        max_active_runs=1,
        auto_register=False,  # only the specs that load are exported (globals below)
        tags=["llm-batch", "recurring", *spec.tags],
        doc_md=(f"Recurring batch from spec `{spec.name}`: model `{spec.model}`, endpoint `{spec.endpoint.value}`."
                f" Output asset: `{spec.output_asset}` (updated when a run's batch succeeds)."),
    ) as dag:
        TriggerDagRunOperator(
            task_id="start_batch",
            trigger_dag_id=BATCH_DAG_ID,
            conf=spec.run_conf(),  # a template field: input/output render with this run's context
            wait_for_completion=False,
        )
    return dag


def _load_all(folder: Path) -> dict[str, DAG]:
    dags: dict[str, DAG] = {}
    broken: dict[str, str] = {}
    for path in spec_files(folder):
        try:
            dag = _dag_for(load_spec(path))
            dag.validate()  # e.g. a bad cron: name the spec instead of failing at bagging
        except Exception as exc:  # noqa: BLE001 - any broken spec must not hide the others
            broken[f"{DAG_ID_PREFIX}{path.stem}"] = str(exc) if isinstance(exc, RecurringSpecError) else f"{path.name}: {exc}"
        else:
            dags[dag.dag_id] = dag
    # Airflow keeps one import error per file: each stand-in carries every broken spec's reason.
    reasons = "broken recurring specs: " + " | ".join(broken.values())
    for dag_id in broken:
        dags[dag_id] = BrokenSpecDag(dag_id=dag_id, schedule=None, description=reasons)
    return dags


for _folder in SPEC_FOLDERS:
    globals().update(_load_all(_folder))
