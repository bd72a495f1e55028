"""The production shape on one machine (``llm-batch up --executor celery``): CeleryExecutor
with a Redis broker, PostgreSQL for Airflow and the job store, SeaweedFS S3 for every file,
two Celery workers each with a home and model cache of its own (docs/production-shape.md).

``celery_shape`` (this package's, stopped when its tests are done) starts it under a new home with the tiny
model prepared in each worker's cache. Jobs go through the native route with inline
requests (``/batch/v1/jobs``): nothing names a path on anybody's disk. Which worker ran a
shard is the task instance's ``hostname`` (each worker names itself ``celery-worker-<n>``).
"""

from __future__ import annotations

import os
import re
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from llm_batch.devstack.supervisor import read_restarts
from tests.e2e.conftest import NOT_IN_PROCESS_AIRFLOW, read_jsonl, settings_with, wait_until
from tests.fixtures.engine import TINY_MODEL

pytestmark = [pytest.mark.e2e, pytest.mark.airflow, pytest.mark.engine, pytest.mark.postgres, pytest.mark.s3]

JOB_TIMEOUT_S = 600


@pytest.fixture(scope="package")
def celery_shape(tmp_path_factory: pytest.TempPathFactory, engine_env: None) -> Iterator[Any]:
    from llm_batch.devstack.celery_stack import CeleryStack
    from llm_batch.devstack.stack import free_port

    env = {
        # As for e2e_stack: no in-process Airflow test settings in the real components.
        **NOT_IN_PROCESS_AIRFLOW,
        # The shape's own choice of engines (its default: a worker per shard), not the suite's.
        "LLM_BATCH_WARM_ENGINES": None,
        "LLM_BATCH_SHARD_RETRY_DELAY_SECONDS": "2",
        # A task of a killed worker is failed (and retried) after 45 s, not 5 min. No less: a
        # running task's supervisor heartbeats through the api-server (every [workers]
        # min_heartbeat_interval, 5 s), and the api-server's restart (its stop, Airflow's start,
        # a first request of ~10 s) left the held shards 35-37 s without a heartbeat on this
        # 2-core machine under load (load average 5-6): at 30 s both failed and were retried.
        "AIRFLOW__SCHEDULER__TASK_INSTANCE_HEARTBEAT_TIMEOUT": "45",
        # ... and looked for every 2 s, not 10 (a query of the running task instances): the
        # killed worker's shard is retried 45-47 s after its last heartbeat, not 45-55 s.
        "AIRFLOW__SCHEDULER__TASK_INSTANCE_HEARTBEAT_TIMEOUT_DETECTION_INTERVAL": "2",
    }
    home = tmp_path_factory.mktemp("celery-shape")
    stack = CeleryStack.create(settings_with(env, home=home, warm_engines=False), free_port(), workers=2,
                               extra_env=env)
    # The model is prepared in the workers' caches while the stack starts (it needs none of
    # it); env() first makes the shared files (the JWT secret) that both would otherwise race to.
    stack.env()
    prepared: list[BaseException] = []

    def prepare() -> None:
        try:
            stack.prepare_model(TINY_MODEL)
        except BaseException as exc:  # noqa: BLE001 (raised below, in the fixture)
            prepared.append(exc)

    preparing = threading.Thread(target=prepare, name="prepare-model")
    preparing.start()
    try:
        try:
            stack.up(timeout=420)
        finally:
            preparing.join()
        if prepared:
            raise prepared[0]
    except BaseException:
        print(shape_logs(stack))
        stack.down()
        raise
    yield stack
    stopping = time.monotonic()
    # A throw-away stack: whatever has not exited 5 s after SIGTERM is killed (the api-server
    # takes ~6 s to exit after its server finished, a Celery worker waits for its running task).
    stack.down(grace=5)
    print(f"the shape stopped in {time.monotonic() - stopping:.1f} s")
    shutil.rmtree(stack.pg_root, ignore_errors=True)


def shape_logs(stack: Any, lines: int = 40) -> str:
    logs = [*sorted(stack.log_dir.glob("*.log"))]
    logs += [stack.worker_log(n) for n in range(1, stack.workers + 1)]
    logs += sorted(stack.shape_dir.glob("celery-worker-*/airflow/logs/dag_id=*/**/*.log"))
    parts = []
    for log in logs:
        try:
            tail = "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
        except OSError as exc:
            tail = f"(unreadable: {exc})"
        parts.append(f"===== {log}\n{tail}")
    return "\n".join(parts)


@pytest.fixture
def shape(request, celery_shape) -> Iterator[Any]:
    """The shape; its logs printed when the test fails."""
    yield celery_shape
    report = getattr(request.node, "report_call", None)
    if report is not None and report.failed:
        print(shape_logs(celery_shape))


def _api(stack: Any) -> httpx.Client:
    return httpx.Client(base_url=f"{stack.base_url}/batch", timeout=60,
                        headers={"Authorization": f"Bearer {stack.ensure_api_key()}"})


def _airflow(stack: Any) -> httpx.Client:
    return httpx.Client(base_url=f"{stack.base_url}/api/v2", timeout=60,
                        headers={"Authorization": f"Bearer {stack.airflow_token()}"})


def requests_of(count: int, *, first_tokens: int, step: int) -> list[dict[str, Any]]:
    """Inline chat requests; request i generates exactly first_tokens + i * step tokens."""
    return [
        {"custom_id": f"req-{i:04d}", "body": {
            "model": TINY_MODEL, "messages": [{"role": "user", "content": f"request {i}: count slowly"}],
            "max_tokens": first_tokens + i * step, "ignore_eos": True, "temperature": 0}}
        for i in range(count)
    ]


# Two sequences at a time: a job whose shards take long enough for a fault mid-shard (with
# the default 256, the tiny model finishes a 30-request shard in ~13 s here).
SLOW = {"engine_args": {"max_num_seqs": 2}}


def submit(stack: Any, requests: list[dict[str, Any]], shards: int,
           model_config: dict[str, Any] | None = None) -> dict[str, Any]:
    with _api(stack) as api:
        created = api.post("/v1/jobs", json={"requests": requests, "model": TINY_MODEL,
                                              "data_parallelism": shards, "model_config": model_config or {}})
    assert created.status_code in (200, 201), created.text
    return created.json()


def job(stack: Any, job_id: str) -> dict[str, Any]:
    with _api(stack) as api:
        answer = api.get(f"/v1/jobs/{job_id}")
    answer.raise_for_status()
    return answer.json()


def wait_job(stack: Any, job_id: str, timeout: float = JOB_TIMEOUT_S) -> dict[str, Any]:
    return wait_until(f"job {job_id} to end", lambda: (j := job(stack, job_id))["terminal"] and j, timeout, poll=0.5)


def results(stack: Any, file_id: str) -> list[dict[str, Any]]:
    with _api(stack) as api:
        content = api.get(f"/v1/files/{file_id}/content")
    content.raise_for_status()
    return read_jsonl(content.content)


def shard_tries(stack: Any, run_id: str) -> dict[int, list[dict[str, Any]]]:
    """Every try of every shard task of the run: {map_index: [try, ...]} (oldest first)."""
    with _airflow(stack) as airflow:
        listed = airflow.get(f"/dags/batch_inference/dagRuns/{run_id}/taskInstances", params={"limit": 100})
        listed.raise_for_status()
        # Mapped shard tasks (a lane without shards has one skipped, unmapped instance: -1).
        shards = [ti for ti in listed.json()["task_instances"]
                  if ti["task_id"] == "run_shard" and ti["map_index"] >= 0]
        tries = {}
        for ti in shards:
            answer = airflow.get(f"/dags/batch_inference/dagRuns/{run_id}/taskInstances/{ti['task_id']}/"
                                 f"{ti['map_index']}/tries")
            answer.raise_for_status()
            tries[ti["map_index"]] = sorted(answer.json()["task_instances"], key=lambda t: t["try_number"])
    return tries


def running_shards(stack: Any, run_id: str) -> dict[int, str]:
    """{map_index: hostname} of the shard tasks running now."""
    with _airflow(stack) as airflow:
        listed = airflow.get(f"/dags/batch_inference/dagRuns/{run_id}/taskInstances", params={"limit": 100})
    listed.raise_for_status()
    return {ti["map_index"]: ti["hostname"] for ti in listed.json()["task_instances"]
            if ti["task_id"] == "run_shard" and ti["state"] == "running" and ti["hostname"]}


def shard_progress(stack: Any, job_id: str, shard: int) -> dict[str, Any] | None:
    """The shard's progress.json on S3 (None before the worker first published it)."""
    client = stack.s3_client()
    try:
        body = client.get_object(Bucket="llm-batch", Key=f"work/{job_id}/shards/{shard:05d}/progress.json")["Body"]
    except client.exceptions.NoSuchKey:
        return None
    return orjson.loads(body.read())


def _exactly_once(stack: Any, ended: dict[str, Any], ids: list[str]) -> None:
    assert ended["status"] == "SUCCEEDED", ended
    assert ended["counts"]["total"] == len(ids) and ended["counts"]["succeeded"] == len(ids), ended["counts"]
    lines = results(stack, ended["output_file_id"])
    assert [line["custom_id"] for line in lines] == ids  # each exactly once, in input order
    assert ended["error_file_id"] is None or results(stack, ended["error_file_id"]) == []


def _ran_on_workers_and_counted(shape: Any, ended: dict[str, Any], shards: int) -> None:
    """What a job run on the shape shows once it ended: every task ran on a worker (the
    scheduler runs nothing itself), and the shape's /batch/metrics counts it."""
    tries = shard_tries(shape, ended["dag_run_id"])
    assert sorted(tries) == list(range(shards))
    with _airflow(shape) as airflow:
        tis = airflow.get(f"/dags/batch_inference/dagRuns/{ended['dag_run_id']}/taskInstances",
                          params={"limit": 100}).json()["task_instances"]
    assert {ti["hostname"] for ti in tis if ti["state"] == "success"} <= {"celery-worker-1", "celery-worker-2"}
    # The shape's /batch/metrics gives the same figures as the embedded stack's: read from
    # PostgreSQL (the job store, Airflow's metadata), whichever process answers.
    from prometheus_client.parser import text_string_to_metric_families

    with _api(shape) as api:
        scraped = api.get("/metrics")
    assert scraped.status_code == 200, scraped.text
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(scraped.text) for s in family.samples}
    assert samples[("llm_batch_jobs", (("model", TINY_MODEL), ("status", "SUCCEEDED")))] >= 1
    assert ("llm_batch_queue_jobs", (("pool", "llm_batch_local"),)) in samples
    assert samples[("llm_batch_shard_tries", ())] >= sum(len(t) for t in tries.values())  # this job's at least
    assert samples[("llm_batch_airflow_scheduler_heartbeat_age_seconds", ())] < 120


def hold_shards(stack: Any, job_id: str, after_results: int) -> None:
    """Each shard's first attempt holds once ``after_results`` of its results are on S3, until
    ``release_shards`` (the worker's hold point, llm_batch.runtime.worker.HoldPoint): a fault
    lands mid-shard by construction."""
    stack.s3_client().put_object(Bucket="llm-batch", Key=f"work/{job_id}/hold",
                                 Body=orjson.dumps({"after_results": after_results}))


def release_shards(stack: Any, job_id: str) -> None:
    stack.s3_client().delete_object(Bucket="llm-batch", Key=f"work/{job_id}/hold")


def test_a_killed_worker_s_shard_resumes_and_the_worker_comes_back(shape):
    started = time.monotonic()
    requests = requests_of(12, first_tokens=8, step=2)
    created = submit(shape, requests, shards=2, model_config={"engine_args": {"max_num_seqs": 1}})
    job_id = created["id"]
    hold_shards(shape, job_id, 3)  # the kill lands mid-shard by construction
    run_id = wait_until("the job's run", lambda: job(shape, job_id)["dag_run_id"], 120)
    # Mid-shard: a shard runs on worker 1 and has checkpointed some results to S3.
    # (A 1-tuple: shard 0 is falsy, and wait_until waits for something truthy.)
    [victim] = wait_until(
        "a shard on celery-worker-1 with results",
        lambda: next(((s,) for s, host in running_shards(shape, run_id).items() if host == "celery-worker-1"
                      and ((shard_progress(shape, job_id, s) or {}).get("done") or 0) >= 3), None),
        JOB_TIMEOUT_S, poll=0.2,
    )
    before = shard_progress(shape, job_id, victim)
    assert before["done"] < before["total"], f"shard {victim} ended before the kill: {before}"
    killed = shape.kill_worker(1)
    print(f"{time.monotonic() - started:6.1f} s shard {victim} killed mid-shard: {before}")
    release_shards(shape, job_id)  # the other shard; the retry resumes and never holds
    try:
        # The stack's supervisor starts the worker again by itself.
        wait_until("worker 1 started again", lambda: shape.pid_of("celery-worker-1") not in (None, killed), 60)
        assert read_restarts(shape)["celery-worker-1"]["reason"] == "killed by SIGKILL"
        ended = wait_job(shape, job_id)
        print(f"{time.monotonic() - started:6.1f} s ended")
        _exactly_once(shape, ended, [r["custom_id"] for r in requests])
        tries = shard_tries(shape, run_id)[victim]
        print(f"shard {victim} tries:", [(t["try_number"], t["hostname"], t["state"], t["start_date"], t["end_date"])
                                         for t in tries])
        # The retry runs on whichever worker is free first: worker 2, or worker 1 back.
        assert tries[0]["hostname"] == "celery-worker-1"
        assert tries[-1]["state"] == "success" and len(tries) >= 2
        after = shard_progress(shape, job_id, victim)
        # The retry started from the checkpoint on S3: what the killed try finished was kept.
        assert after["resumed"] >= before["done"], (before, after)
    finally:
        shape.workers_up(timeout=180)  # worker 1 again, for whatever runs next


def _mid_job(shape: Any, count: int, shards: int = 2) -> tuple[list[dict[str, Any]], str, str]:
    """A job each of whose shards holds once 3 of its results are checkpointed to S3
    (hold_shards), so every fault lands mid-shard by construction (a shard still starting
    would meet it while it reads its requests, which no retry within the outage can help):
    (requests, job id, run id)."""
    requests = requests_of(count, first_tokens=8, step=1)
    job_id = submit(shape, requests, shards=shards, model_config=SLOW)["id"]
    hold_shards(shape, job_id, 3)
    run_id = wait_until("the job's run", lambda: job(shape, job_id)["dag_run_id"], 120)
    wait_until("every shard held with results", lambda: all(
        ((shard_progress(shape, job_id, s) or {}).get("done") or 0) >= 3 for s in range(shards)),
        JOB_TIMEOUT_S, poll=1)
    return requests, job_id, run_id


def _tries(shape: Any, run_id: str) -> dict[int, list[tuple[int, str, str]]]:
    return {s: [(t["try_number"], t["hostname"], t["state"]) for t in ts] for s, ts in shard_tries(shape, run_id).items()}


def _done(shape: Any, job_id: str, shards: int) -> int:
    return sum((shard_progress(shape, job_id, s) or {}).get("done") or 0 for s in range(shards))


def _shard_log(shape: Any, run_id: str, shard: int) -> str:
    """The first attempt's task log of the shard (on whichever worker ran it): what the
    shard's worker process logged, read where the worker keeps it (not on S3)."""
    logs = [shape.worker_home(n) / "airflow" / "logs" / "dag_id=batch_inference" / f"run_id={run_id}"
            / "task_id=run_shard" / f"map_index={shard}" / "attempt=1.log" for n in range(1, shape.workers + 1)]
    return "".join(log.read_text(errors="replace") for log in logs if log.exists())


def _held_after(shape: Any, run_id: str, shard: int) -> list[int]:
    """How many results the shard had each time it held (HoldPoint), in order."""
    return [int(n) for n in re.findall(rf"shard {shard} held after (\d+) results", _shard_log(shape, run_id, shard))]


def test_a_job_spreads_over_both_workers_and_outlasts_an_s3_outage_and_restarts_of_the_api_server_the_scheduler_and_postgresql(  # noqa: E501
        shape):
    """One job through every fault of the shared services in turn (one job, not one each: each
    job costs minutes of the suite), its shards held mid-run (the worker's hold point), one on
    each worker: a worker runs one task at a time, so the two shards held at once ran on both
    (the job spread over both workers; its tasks all ran on workers, the metrics count it). First
    the S3 server killed mid-shard, once each shard has seen its hold point move on, and started
    again once each has kept results it could not publish (or holds again): the workers keep
    their results buffered (ResultsWriter's outage_s) and publish them once it is back, and no
    shard needs another try for it. Then the api-server and the
    scheduler stopped, and the stack's supervisor starts each again; then PostgreSQL stopped
    (a fast shutdown, dropping every connection) until the scheduler, dag-processor and
    triggerer have exited on it. Airflow's scheduler, dag-processor
    and triggerer exit when the metadata DB refuses connections (their supervisor restarts
    them: in production Kubernetes, compose's ``restart:``; here the stack's); the
    api-server and the workers' tasks ride it out. The job ends SUCCEEDED with every request once, and no job is
    left live."""
    started = time.monotonic()
    # Each shard (8 requests) holds after 3 results; through the S3 outage it runs on towards
    # its next hold point, 4 results later, buffering what it finishes, and holds there through
    # the restarts: the job is mid-run at every fault, whatever the machine's speed.
    requests, job_id, run_id = _mid_job(shape, 16)
    before = _done(shape, job_id, 2)

    def phase(name: str) -> None:  # where the time goes (printed when the test fails)
        print(f"{time.monotonic() - started:6.1f} s {name}: {_done(shape, job_id, 2)}/{len(requests)} done")

    phase("held mid-job")
    hold_shards(shape, job_id, 3 + 4)
    # Killed once each shard runs on (it reads its hold point on S3: killed before, it would
    # stay held through the outage, S3 unable to say otherwise) ...
    wait_until("every shard released to its next hold point", lambda: all(
        "released (next hold: 7)" in _shard_log(shape, run_id, s) for s in range(2)), 120, poll=0.1)
    shape.stop_service("s3")
    down = time.monotonic()
    try:
        # ... and started again once each has kept results it could not publish (its worker
        # logs it), or holds again having finished them all before the kill. (Not until each
        # holds again: with S3 down a shard runs on at a crawl, each engine step waiting on
        # the S3 calls it retries, and may take minutes over its next 4 results.)
        wait_until("every shard kept results through the outage or held again", lambda: all(
            "results not published yet" in _shard_log(shape, run_id, s)
            or any(n >= 3 + 4 for n in _held_after(shape, run_id, s)) for s in range(2)), JOB_TIMEOUT_S, poll=0.2)
    finally:
        restarting = time.monotonic()
        shape.services_up()
    print(f"S3 down {restarting - down:.1f} s, its start {time.monotonic() - restarting:.1f} s; results kept "
          "while it was down:", {s: "results not published yet" in _shard_log(shape, run_id, s) for s in range(2)},
          "held after:", {s: _held_after(shape, run_id, s) for s in range(2)})
    wait_until("results published after the outage", lambda: _done(shape, job_id, 2) > before, JOB_TIMEOUT_S, poll=0.5)
    tries = _tries(shape, run_id)
    phase("published after the S3 outage")
    print("shard tries after the S3 outage:", tries)
    assert all(len(t) == 1 for t in tries.values()), tries
    # The job spread its shards over both workers (both ran at once).
    assert sorted(tries) == [0, 1]
    ran_on = {shard: t[-1][1] for shard, t in tries.items()}
    print("shard -> worker:", ran_on)
    assert set(ran_on.values()) == {"celery-worker-1", "celery-worker-2"}, ran_on
    assert not job(shape, job_id)["terminal"], "the job ended before the restarts were tested"

    for component in ("api-server", "scheduler"):
        stopped = shape.running()[component]
        shape.stop_component(component, grace=10)
        wait_until(f"the {component} started again", lambda: shape.running()[component] not in (None, stopped), 60,
                   poll=0.2)
        assert shape.up(timeout=300).started == (), "up found something to start"
        phase(f"the {component} restarted")
        assert not job(shape, job_id)["terminal"], f"the job ended before the {component} restart was tested"
    exiting = {c: shape.running()[c] for c in ("scheduler", "dag-processor", "triggerer")}
    shape.stop_service("postgres")
    try:
        wait_until("the scheduler, dag-processor and triggerer to exit on the outage",
                   lambda: all(shape.running()[c] != pid for c, pid in exiting.items()), 120, poll=0.2)
    finally:
        shape.services_up()
    restarted = shape.up(timeout=300).started  # (the supervisor may not have started them all yet)
    phase("after the restarts")
    print("restarted after the PostgreSQL restart:", restarted, read_restarts(shape))
    assert set(restarted) <= {"scheduler", "dag-processor", "triggerer"}, restarted
    release_shards(shape, job_id)
    ended = wait_job(shape, job_id)
    phase("ended")
    print("shard tries:", _tries(shape, run_id))
    _exactly_once(shape, ended, [r["custom_id"] for r in requests])
    _ran_on_workers_and_counted(shape, ended, shards=2)
    with _api(shape) as api:
        listed = api.get("/v1/jobs", params={"limit": 100}).json()["data"]
    assert [j["id"] for j in listed if not j["terminal"]] == []  # no job stuck live


def test_no_component_has_a_file_open_under_another_s_home(shape):
    """While idle and after the jobs above: each process of the shape has open files only in
    its own home (or outside every home: code, the venv, /tmp, sockets)."""
    from llm_batch.devstack.celery_stack import _descendants

    homes = {"control": shape.settings.home, **{shape.worker_name(n): shape.worker_home(n)
                                                for n in range(1, shape.workers + 1)}}

    def owner(path: str) -> str | None:
        best = None
        for name, home in homes.items():
            if path.startswith(f"{home}/"):
                # The longest home wins: a worker's home is inside the control plane's.
                if best is None or len(str(home)) > len(str(homes[best])):
                    best = name
        return best

    components = {c: (pid, "control") for c, pid in shape.running().items() if pid}
    components |= {shape.worker_name(n): (shape.pid_of(shape.worker_name(n)), shape.worker_name(n))
                   for n in range(1, shape.workers + 1)}
    foreign = []
    for component, (pid, own) in components.items():
        assert pid, f"{component} is not running"
        for proc in _descendants(pid):
            try:
                fds = list(Path(f"/proc/{proc}/fd").iterdir())
            except OSError:
                continue
            for fd in fds:
                try:
                    target = os.readlink(fd)
                except OSError:
                    continue
                holder = owner(target)
                if holder is not None and holder != own:
                    foreign.append((component, proc, target))
    assert foreign == [], foreign
