"""A waiting job's place in Airflow's queue (native `queue`), and a cancel that takes its
waiting shards out of it.

The runs are really triggered in Airflow's metadata DB (tests/api/conftest.py); no scheduler
runs here, so the shard tasks' states are set as the scheduler would leave them: scheduled
(waiting for a pool slot), queued or running (under way).
"""

from __future__ import annotations

import uuid

import pytest

pytestmark = pytest.mark.usefixtures("airflow_dags_in_db")

def _create(client, creds, owner: str = "alice", priority: str | None = None) -> str:
    body = {"model": "tiny-random-llama", "labels": {"t": "queue"},
            "requests": [{"custom_id": "a", "body": {"messages": [{"role": "user", "content": "hi"}]}}]}
    if priority:
        body["priority"] = priority
    made = client.post("/v1/jobs", headers=creds.key(owner), json=body)
    assert made.status_code in (200, 201), made.text
    return made.json()["id"]


def _shard_waits(job_id: str, api_store, pool: str, state: str = "scheduled") -> None:
    """The run's shard task as the scheduler leaves it after expanding one shard: map index
    0, in `pool`, at the job's weight, in `state`."""
    from airflow.models.taskinstance import TaskInstance as TI
    from airflow.utils.session import create_session

    from llm_batch.core.run_conf import SHARD_TASK_ID

    job = api_store.get_job(job_id)
    with create_session() as session:
        updated = session.query(TI).filter(TI.run_id == job.dag_run_id, TI.task_id == SHARD_TASK_ID).update(
            {TI.state: state, TI.pool: pool, TI.map_index: 0, TI.priority_weight: job.priority},
            synchronize_session=False)
        assert updated == 1


def _prepare_done(job_id: str, api_store) -> None:
    """The run started (no scheduler here starts it) and its prepare task succeeded."""
    from airflow.models.dagrun import DagRun
    from airflow.models.taskinstance import TaskInstance as TI
    from airflow.utils.session import create_session

    run_id = api_store.get_job(job_id).dag_run_id
    api_store.transition(job_id, "VALIDATING")  # as prepare moves it
    api_store.transition(job_id, "RUNNING")
    with create_session() as session:
        session.query(DagRun).filter(DagRun.run_id == run_id).update({DagRun.state: "running"}, synchronize_session=False)
        session.query(TI).filter(TI.run_id == run_id, TI.task_id == "prepare").update(
            {TI.state: "success"}, synchronize_session=False)


@pytest.fixture
def pool() -> str:
    """A pool of one slot of this test's own (the metadata DB is the session's)."""
    from airflow.models.pool import Pool
    from airflow.utils.session import create_session

    name = f"queue_test_{uuid.uuid4().hex[:8]}"
    with create_session() as session:
        session.add(Pool(pool=name, slots=1, description="queue test", include_deferred=False))
    return name


def _queue(client, creds, job_id: str, owner: str = "alice") -> dict | None:
    got = client.get(f"/v1/jobs/{job_id}", headers=creds.key(owner))
    assert got.status_code == 200, got.text
    return got.json()["queue"]


def test_waiting_jobs_show_their_place_band_first_then_submission_time(client, creds, api_store, pool):
    normal = [_create(client, creds) for _ in range(3)]
    high = _create(client, creds, owner="bob", priority="high")  # submitted last, a higher band
    for job_id in [*normal, high]:
        _prepare_done(job_id, api_store)
        _shard_waits(job_id, api_store, pool)
    places = {job_id: _queue(client, creds, job_id, "bob" if job_id == high else "alice")
              for job_id in [*normal, high]}
    assert places[high]["position"] == 1
    assert [places[j]["position"] for j in normal] == [2, 3, 4]
    for place in places.values():
        assert place["pool"] == pool
        assert place["waiting_for"] == f"a slot of pool {pool} (0 of 1 in use)"

    # The first normal job starts (its shard queued: it holds the pool's slot): it has no
    # place any more, the others move up, and the slot reads as in use.
    _shard_waits(normal[0], api_store, pool, state="queued")
    assert _queue(client, creds, normal[0]) is None
    assert [_queue(client, creds, j)["position"] for j in normal[1:]] == [2, 3]
    assert _queue(client, creds, normal[1])["waiting_for"] == f"a slot of pool {pool} (1 of 1 in use)"

    # The list answers the same places (one page, a few queries).
    listed = client.get("/v1/jobs", headers=creds.key("alice"), params={"label": "t=queue", "limit": 100})
    by_id = {j["id"]: j["queue"] for j in listed.json()["data"]}
    assert by_id[normal[0]] is None and by_id[normal[2]]["position"] == 3

    # Another owner's job counts in the line but is never shown to alice.
    assert client.get(f"/v1/jobs/{high}", headers=creds.key("alice")).status_code == 404


def test_a_cancel_takes_the_waiting_shards_out_of_the_queue(client, creds, api_store, pool):
    from airflow.models.taskinstance import TaskInstance as TI
    from airflow.utils.session import create_session

    first, second = _create(client, creds), _create(client, creds)
    for job_id in (first, second):
        _prepare_done(job_id, api_store)
        _shard_waits(job_id, api_store, pool)
    assert _queue(client, creds, second)["position"] == 2

    cancelled = client.post(f"/v1/jobs/{first}/cancel", headers=creds.key("alice"))
    assert cancelled.status_code == 200, cancelled.text
    assert cancelled.json()["status"] == "CANCELLING"
    with create_session() as session:
        states = [s for (s,) in session.query(TI.state).filter(
            TI.run_id == api_store.get_job(first).dag_run_id, TI.task_id == "run_shard")]
    assert states == ["skipped"]  # the finalize task (all_done) now runs without waiting for a slot
    assert _queue(client, creds, first) is None
    assert _queue(client, creds, second)["position"] == 1  # the cancelled job no longer stands before it


def test_a_cancel_leaves_a_running_shard_to_stop_at_its_checkpoint(client, creds, api_store, pool):
    from airflow.models.taskinstance import TaskInstance as TI
    from airflow.utils.session import create_session

    job_id = _create(client, creds)
    _prepare_done(job_id, api_store)
    _shard_waits(job_id, api_store, pool, state="running")
    for path in (f"/v1/batches/{job_id}/cancel",):  # the OpenAI dialect's route takes the same way
        assert client.post(path, headers=creds.key("alice")).status_code == 200
    with create_session() as session:
        (state,) = session.query(TI.state).filter(TI.run_id == api_store.get_job(job_id).dag_run_id,
                                                  TI.task_id == "run_shard").one()
    assert state == "running"


def test_a_run_that_waits_to_start_says_so(client, creds, api_store):
    from airflow.models.dagrun import DagRun
    from airflow.utils.session import create_session

    job_id = _create(client, creds)
    with create_session() as session:
        session.query(DagRun).filter(DagRun.run_id == api_store.get_job(job_id).dag_run_id).update(
            {DagRun.state: "queued"}, synchronize_session=False)
    place = _queue(client, creds, job_id)
    assert place["pool"] is None and place["position"] >= 1
    assert place["waiting_for"].startswith("a run slot of DAG batch_inference")


def test_an_unknown_or_foreign_job_has_no_queue_to_read(client, creds):
    assert client.get(f"/v1/jobs/job_{uuid.uuid4().hex}", headers=creds.key("alice")).status_code == 404


def test_a_run_waiting_to_start_stands_behind_the_started_ones(client, creds, api_store, pool):
    """One line: a job whose run waits to start at all has its place behind every started
    run still waiting for a pool's slot, never the same number as one of them."""
    started, waiting = _create(client, creds), _create(client, creds)
    _prepare_done(started, api_store)
    _shard_waits(started, api_store, pool)  # `waiting`'s run stays queued: no scheduler here
    first = _queue(client, creds, started)
    place = _queue(client, creds, waiting)
    assert first["position"] == 1 and first["pool"] == pool
    assert place["pool"] is None and place["position"] > 1, place
    listed = client.get("/v1/jobs", headers=creds.key("alice"), params={"label": "t=queue", "limit": 100})
    assert {j["id"]: j["queue"] for j in listed.json()["data"]}[waiting] == place
