"""Scheduling overhead per shard with the Kubernetes runner, on the production shape, against the Kubernetes API stub.

    .venv/bin/python benchmarks/k8s_overhead.py [--shards 64] [--workers 2] [--pod-seconds 0]

The Kubernetes-runner twin of benchmarks/celery_overhead.py (which gives the local-runner
figure). Starts the Kubernetes API stub (tests/fixtures/kube_stub.py) on 127.0.0.1 in this
process, then the Celery shape (benchmarks/shape.py ``temp_shape``: CeleryExecutor, Redis,
PostgreSQL, SeaweedFS S3, N Celery workers with homes of their own) under a temporary
LLM_BATCH_HOME with ``LLM_BATCH_SHARD_RUNNER=kubernetes`` and ``KUBECONFIG`` naming the
stub's kubeconfig, both in the environment the shape's components inherit (the shape passes
its caller's environment on: the workers run the pod operator's execute and re-entry, the
triggerer the pod trigger; the connection is None, so the provider's hooks read KUBECONFIG).
Submits one job of ``--shards`` shards x 1 request on the tiny model (native route, inline
requests; default gpu_type: one lane) and waits for it to end.

Each shard is a ``KubernetesShardOperator`` as in production: deferrable, so a shard is two
Celery tasks (execute: build the pod, find + create it, defer; re-entry after the trigger's
event: read the pod, its log, delete it, record the outcome) with the triggerer polling the
pod between them (the provider's 2 s poll). The stub has no kubelet: a pod runs nothing and
ends (exit 0) ``--pod-seconds`` after its creation (0: at its first read). So the engine time
is 0 and the shard phase is pure scheduling overhead: Airflow's dispatch, the operator's pod
create / poll / log / delete round trips, the deferral and the resume.

Pods write no results, so the job does not succeed as a real one would: merge finds no
results and the job ends FAILED. That is expected; the script prints the job's final state,
and its figure is the shard phase only (plan done -> last shard task done).

Prints, with Airflow's timestamps of the run's task instances, the stub's of each pod, and
the Celery workers' own logs:

- wall: plan done -> last shard done; overhead per shard = wall x Celery workers / shards
  (worker-slot seconds per shard, as celery_overhead.py counts them, with engine 0), and
  wall / shards;
- medians over shards: started -> ended (first start to final end: the deferral included),
  and its parts: start -> pod created, pod created -> the triggerer sees it ended, -> the
  resume queued, queued -> started of the resume (it reads the pod's log first; Airflow
  overwrites the first dispatch's queued time at the resume, so that one is not known),
  resume -> task ended;
- plan done -> first shard started;
- one worker's task end -> its next task start (median, from the ``succeeded in`` lines of
  each worker's celery-worker.log, within the shard phase; both halves of a shard are
  tasks), the Celery tasks' median length, how busy the workers were and their busy
  seconds per shard;
- how many pods the stub saw created and deleted (each shard's pod once and once).

Target: overhead per shard under 2 s.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import sys
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # benchmarks.shape, tests.fixtures.kube_stub

TARGET_S = 2.0
# A Celery task's end in a worker's log: "<ISO time>Z [info ] Task <name>[<id>] succeeded in <s>s: ..."
_SUCCEEDED = re.compile(r"^(\d{4}-\d\d-\d\dT\S+Z)\s.*?\bTask \S+\[[^\]]+\] succeeded in ([0-9.]+)s")


def celery_spans(stack: Any) -> dict[str, list[tuple[float, float]]]:
    """Per worker, the (start, end) of each Celery task it ran, from its celery-worker.log."""
    from benchmarks.shape import ts

    spans: dict[str, list[tuple[float, float]]] = {}
    for n in range(1, stack.workers + 1):
        found = spans.setdefault(stack.worker_name(n), [])
        try:
            lines = stack.worker_log(n).read_text(errors="replace").splitlines()
        except OSError:
            continue
        for line in lines:
            match = _SUCCEEDED.match(line)
            if match:
                end = ts(match.group(1))
                found.append((end - float(match.group(2)), end))
        found.sort()
    return spans


def _median(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} s" if values else "n/a"


def report(stack: Any, stub: Any, job: dict[str, Any], args: argparse.Namespace) -> int:
    from benchmarks.shape import all_task_instances, run_task_instances, ts

    tis = all_task_instances(stack, job)
    plan, shards = run_task_instances(stack, job, tis)
    if not shards:
        print(f"job {job['id']}: no shard task instances ({job['status']}: {job.get('status_reason')})")
        return 1
    plan_end = ts(plan["end_date"])
    ended = [ti for ti in shards if ti.get("end_date")]
    last_end = max(ts(ti["end_date"]) for ti in ended) if ended else plan_end
    wall = last_end - plan_end
    states = Counter(ti["state"] for ti in shards)
    tries = sum(ti["try_number"] for ti in shards) - len(shards)
    lanes = sorted({ti["task_id"] for ti in shards})
    print(f"job {job['id']}: {len(shards)} shards x 1 request, Kubernetes runner, {stack.workers} Celery workers "
          f"(GPU pool {stack.settings.gpu_pool_slots} slots; lane {', '.join(lanes)}); pods end "
          f"{args.pod_seconds:g} s after creation; shard tasks {dict(states)}, retries {tries}")
    print(f"job final state: {job['status']} ({job.get('status_reason')}) - expected: the stub's pods run "
          "nothing, so merge finds no results; the figure is the shard phase only")
    slots = stack.workers
    per_shard = wall * slots / len(shards)
    print(f"plan done -> last shard done: {wall:.1f} s; engine 0 s (pods run nothing)")
    verdict = "MET" if per_shard < TARGET_S else "OVER TARGET"
    print(f"overhead per shard: {per_shard:.2f} s = wall x {slots} workers / {len(shards)} shards "
          f"(target < {TARGET_S:.0f} s: {verdict}); wall / shards: {wall / len(shards):.2f} s")

    # Each shard's pod (the provider's map_index label; the first, if a retry made more).
    pods: dict[int, str] = {}
    pods_per_shard: Counter[int] = Counter()
    for name in stub.created:
        labels = stub.pod_labels.get(name, {})
        index = labels.get("map_index", labels.get("llm-batch.io/shard"))
        if index is not None:
            pods.setdefault(int(index), name)
            pods_per_shard[int(index)] += 1

    def part(ti: dict[str, Any], start: str | float | None, end: str | float | None) -> float | None:
        points = []
        for point in (start, end):
            if isinstance(point, str):
                point = ts(ti.get(point)) if point in ti else stub_time(ti, point)
            points.append(point)
        return points[1] - points[0] if None not in points else None

    def stub_time(ti: dict[str, Any], what: str) -> float | None:
        name = pods.get(ti["map_index"])
        table = {"created": stub.created_at, "ended": stub.ended_seen_at, "log": stub.log_read_at,
                 "deleted": stub.deleted_at}[what]
        return table.get(name) if name else None

    def median_of(start: str, end: str) -> str:
        return _median([d for ti in ended if (d := part(ti, start, end)) is not None])

    print(f"  started -> ended (first start to final end, the deferral included), median: "
          f"{median_of('start_date', 'end_date')}")
    print(f"    start -> pod created (task start, operator, find + create), median: {median_of('start_date', 'created')}")
    print(f"    pod created -> the triggerer sees it ended (defer, trigger start, poll), median: "
          f"{median_of('created', 'ended')}")
    print(f"    seen ended -> resume queued (trigger event -> scheduler), median: {median_of('ended', 'queued_when')}")
    print(f"    queued -> started of the resume (broker, pick-up, task start; to its pod log read), median: "
          f"{median_of('queued_when', 'log')}")
    print(f"    resume -> task ended (log, delete, outcome), median: {median_of('log', 'end_date')}")
    first_start = min((ts(ti["start_date"]) for ti in shards if ti.get("start_date")), default=None)
    if first_start is not None:
        print(f"  plan done -> first shard started: {first_start - plan_end:.1f} s")

    spans = celery_spans(stack)
    gaps: list[float] = []
    durations: list[float] = []
    busy = 0.0
    counts = {}
    for worker, worker_spans in spans.items():
        inside = [(s, e) for s, e in worker_spans if e > plan_end and s < last_end]
        counts[worker] = len(inside)
        busy += sum(min(e, last_end) - max(s, plan_end) for s, e in inside)
        durations += [e - s for s, e in inside]
        gaps += [b[0] - a[1] for a, b in zip(inside, inside[1:], strict=False)]
    print(f"  one worker's task end -> its next task start (Celery log, shard phase), median: {_median(gaps)}; "
          f"Celery tasks in the phase: {', '.join(f'{w} {c}' for w, c in sorted(counts.items()))} "
          f"(shard starts and resumes), {_median(durations)} each (median); workers busy "
          f"{100 * busy / (wall * slots) if wall > 0 else 0:.0f} % of the phase, {busy / len(shards):.2f} s per shard")

    pods_seen = stub.summary()
    once = (pods_seen["created"] == pods_seen["deleted"] == len(shards) and not pods_seen["created_twice"]
            and not pods_seen["deleted_twice"] and not pods_seen["left"]
            and all(pods_per_shard.get(ti["map_index"]) == 1 for ti in shards))
    print(f"pods: {pods_seen['created']} created, {pods_seen['deleted']} deleted, created twice "
          f"{len(pods_seen['created_twice'])}, deleted twice {len(pods_seen['deleted_twice'])}, left "
          f"{len(pods_seen['left'])}, shards without a pod {sum(1 for ti in shards if ti['map_index'] not in pods)}: "
          f"{'each created once and deleted once' if once else 'NOT each created once and deleted once'}")
    print(f"stub requests: {', '.join(f'{k} {v}' for k, v in pods_seen['requests'].items())}")
    return 0 if once and states.get("success") == len(shards) else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shards", type=int, default=64)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--pod-seconds", type=float, default=0.0, help="a pod ends this long after its creation")
    parser.add_argument("--timeout", type=float, default=3600.0, help="longest wait for the job (s)")
    parser.add_argument("--keep", action="store_true",
                        help="leave the shape running (prints its home; the stub ends with this script)")
    args = parser.parse_args()

    from benchmarks.shape import batch_api, chat_requests, temp_shape, wait_job
    from tests.fixtures.kube_stub import KubeStub, serve, write_kubeconfig

    stub = KubeStub(exit_code=0, run_seconds=args.pod_seconds)
    server, url = serve(stub)
    conf_dir = Path(tempfile.mkdtemp(prefix="llm-batch-k8s-bench-"))
    # What the shape's components inherit: the runner, and where the cluster is (no
    # in-cluster configuration: the provider's default client tries that first).
    os.environ["LLM_BATCH_SHARD_RUNNER"] = "kubernetes"
    os.environ["KUBECONFIG"] = str(write_kubeconfig(conf_dir / "kubeconfig", url))
    for name in ("KUBERNETES_SERVICE_HOST", "KUBERNETES_SERVICE_PORT"):
        os.environ.pop(name, None)
    print(f"Kubernetes API stub at {url}", file=sys.stderr)
    try:
        with temp_shape(args.workers, keep=args.keep) as stack:
            with batch_api(stack) as api:
                created = api.post("/v1/jobs", json={"requests": chat_requests(args.shards, 4),
                                                      "model": "tiny-random-llama", "data_parallelism": args.shards})
                created.raise_for_status()
                job = wait_job(api, created.json()["id"], timeout=args.timeout, poll=5)
            if not job["terminal"]:
                print(f"job {job['id']} not ended after {args.timeout:.0f} s ({job['status']})", file=sys.stderr)
            return report(stack, stub, job, args)
    finally:
        server.shutdown()
        shutil.rmtree(conf_dir, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())
