"""How long the DAG files take to parse (the issue's figure: all together under 1 s).

Each measurement is a fresh Python process that has imported Airflow's SDK first (as the
dag-processor has) and then parses every file of dags/ once, cold: our own modules'
imports are counted. Prints per-file and total seconds, best and median of N runs, for
each shard runner.

    .venv/bin/python benchmarks/dag_parse.py [--runs 5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

DAGS = Path(__file__).resolve().parents[1] / "dags"

PROBE = """
import json, sys, time
import airflow.sdk
from airflow.dag_processing.dagbag import DagBag
from pathlib import Path
times = {}
for path in sorted(Path(sys.argv[1]).glob("*.py")):
    bag = DagBag(dag_folder=str(path), collect_dags=False)
    start = time.perf_counter()
    bag.collect_dags(dag_folder=str(path), safe_mode=False)
    times[path.name] = time.perf_counter() - start
    assert not bag.import_errors, bag.import_errors
print(json.dumps(times))
"""


def measure(runner: str) -> dict[str, float]:
    home = tempfile.mkdtemp(prefix="dag-parse-")
    env = {
        **os.environ,
        "AIRFLOW_HOME": home,
        "AIRFLOW__CORE__UNIT_TEST_MODE": "True",
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        "LLM_BATCH_HOME": home,
        "LLM_BATCH_SHARD_RUNNER": runner,
    }
    out = subprocess.run([sys.executable, "-c", PROBE, str(DAGS)], env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    for runner in ("local", "kubernetes"):
        runs = [measure(runner) for _ in range(args.runs)]
        totals = [sum(r.values()) for r in runs]
        print(f"runner={runner}: total best {min(totals):.3f}s median {statistics.median(totals):.3f}s over {args.runs} runs")
        for name in runs[0]:
            values = [r[name] for r in runs]
            print(f"  {name:24s} best {min(values):.3f}s median {statistics.median(values):.3f}s")


if __name__ == "__main__":
    main()
