"""A batch run is its job owner's in Airflow's own REST API too (llm_batch.api.run_guard):
which runs a write under /api/v2 names, for every route shape; who may make it; and the
middleware in front of Airflow's real API, with real tokens and runs the batch API triggered:
another user's state, note, clear and delete are refused 403 and leave the run and the job as
they were, the owner's and the admin's pass."""

from __future__ import annotations

import uuid

import pytest
from hypothesis import given
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st

from llm_batch.api import run_guard
from llm_batch.api.run_guard import ADMINS_ONLY, WILDCARD, Target, refusal, targets
from llm_batch.core.run_conf import run_job_id
from tests.fuzzing import examples

pytestmark = pytest.mark.airflow

BATCH = "batch_inference"
PRODUCT = [BATCH, "recurring__nightly", "llm_batch_housekeeping"]
WRITES = ["POST", "PATCH", "PUT", "DELETE"]
# Every route under /api/v2/dags/{dag}/dagRuns/{run}/ that changes a run (Airflow 3's).
RUN_WRITES = [
    ("PATCH", ""), ("DELETE", ""), ("POST", "/clear"),
    ("PATCH", "/taskInstances"),
    ("PATCH", "/taskInstances/finalize"), ("PATCH", "/taskInstances/run_shard/0"),
    ("PATCH", "/taskInstances/finalize/dry_run"), ("DELETE", "/taskInstances/finalize"),
    ("PATCH", "/taskGroupInstances/g"), ("PATCH", "/taskInstances/run_shard/0/hitlDetails"),
    ("POST", "/taskInstances/prepare/xcomEntries"), ("PATCH", "/taskInstances/prepare/xcomEntries/job_id"),
    ("DELETE", "/taskInstances/prepare/xcomEntries/job_id"),
    ("PUT", "/taskInstances/prepare/state-store/k"), ("DELETE", "/taskInstances/prepare/state-store"),
]
run_ids = st.text(st.characters(blacklist_characters="/", blacklist_categories=("Cs",)), min_size=1, max_size=40)
dag_ids = st.sampled_from(PRODUCT) | st.from_regex(r"[a-z][a-z0-9_]{0,20}", fullmatch=True)


def _parts(path: str) -> list[str]:
    return path.removeprefix("/api/v2/").split("/")


@given(dag=dag_ids, run=run_ids, route=st.sampled_from(RUN_WRITES), body=st.none() | st.just({}))
def test_a_write_under_a_run_names_that_run(dag, run, route, body):
    method, tail = route
    named = targets(method, _parts(f"/api/v2/dags/{dag}/dagRuns/{run}{tail}"), body)
    assert Target(dag, None if run == WILDCARD else run) in named


@given(dag=dag_ids, run=run_ids, tail=st.sampled_from(["", "/clear", "/taskInstances", "/taskInstances/t/0"]),
       method=st.sampled_from(["GET", "HEAD", "OPTIONS"]))
def test_reads_name_no_run(dag, run, tail, method):
    assert targets(method, _parts(f"/api/v2/dags/{dag}/dagRuns/{run}{tail}")) == []


def test_batch_triggers_reads_by_post_and_favourites_name_no_run():
    for method, path in [("POST", f"/api/v2/dags/{BATCH}/dagRuns"), ("POST", "/api/v2/dags/mine/dagRuns"), ("POST", "/api/v2/dags/~/dagRuns/list"),
                         ("POST", f"/api/v2/dags/{BATCH}/dagRuns/r/taskInstances/list"),
                         ("POST", f"/api/v2/dags/{BATCH}/favorite"), ("PATCH", "/api/v2/connections/c"),
                         ("POST", "/api/v2/variables")]:
        assert targets(method, _parts(path), {}) == [], path


def test_the_bulk_and_clear_routes_name_the_runs_of_their_bodies():
    def named(method, path, body):
        return targets(method, _parts(path), body)

    bulk = {"actions": [{"action": "update", "entities": [{"dag_id": BATCH, "dag_run_id": "a", "state": "failed"}]},
                        {"action": "delete", "entities": ["b", {"dag_id": "mine", "dag_run_id": "c"}]}]}
    assert named("PATCH", "/api/v2/dags/~/dagRuns", bulk) == [Target(BATCH, "a"), Target("~", "b"), Target("mine", "c")]
    assert named("PATCH", f"/api/v2/dags/{BATCH}/dagRuns", {"actions": [{"entities": ["b"]}]}) == [Target(BATCH, "b")]
    tis = {"actions": [{"action": "update", "entities": [{"task_id": "t", "dag_id": BATCH, "dag_run_id": "x"}, "t2"]}]}
    assert named("PATCH", "/api/v2/dags/~/dagRuns/~/taskInstances", tis) == [
        Target("~", None), Target(BATCH, "x"), Target("~", None)]
    assert named("POST", f"/api/v2/dags/{BATCH}/clearTaskInstances", {"dag_run_id": "r"}) == [Target(BATCH, "r")]
    assert named("POST", f"/api/v2/dags/{BATCH}/clearTaskInstances", {"only_failed": True}) == [Target(BATCH, None)]
    assert named("POST", f"/api/v2/dags/{BATCH}/clearDagRuns", {"dag_runs": [{"dag_run_id": "r"}]}) == [
        Target(BATCH, "r")]
    assert named("POST", f"/api/v2/dags/{BATCH}/clearDagRuns", {"partition_key": "p"}) == [Target(BATCH, None)]
    assert named("POST", f"/api/v2/dags/{BATCH}/clearPartitions", {"run_id": "r"}) == [Target(BATCH, "r")]
    # A body that is not JSON names no run: only the DAG, which is an admin's on a product DAG.
    assert named("PATCH", f"/api/v2/dags/{BATCH}/dagRuns", None) == [Target(BATCH, None)]
    # New runs of the admin's DAGs; a batch run is its user's own job.
    assert named("POST", "/api/v2/dags/recurring__nightly/dagRuns", {}) == [Target("recurring__nightly", None)]
    assert named("POST", "/api/v2/backfills", {"dag_id": "recurring__nightly"}) == [Target("recurring__nightly", None)]
    assert named("POST", "/api/v2/backfills/dry_run", {"dag_id": "recurring__nightly"}) == []
    assert named("POST", f"/api/v2/dags/{BATCH}/dagRuns", {}) == []
    # The DAG itself (pause, delete) and every DAG at once.
    assert named("PATCH", f"/api/v2/dags/{BATCH}", {"is_paused": True}) == [Target(BATCH, None)]
    assert named("PATCH", "/api/v2/dags", {"is_paused": True}) == [Target(WILDCARD, None)]


@given(user=st.sampled_from(["alice", "bob"]), owners=st.lists(st.sampled_from(["alice", "bob", ADMINS_ONLY, None]),
                                                              min_size=1, max_size=4),
       dag=st.sampled_from(PRODUCT))
def test_a_user_changes_a_product_dags_runs_only_when_each_is_hers(user, owners, dag):
    runs = {f"r{i}": owner for i, owner in enumerate(owners)}
    why = refusal(user, [Target(dag, run) for run in runs], lambda _dag, run: runs[run])
    # A run that does not exist (None) is Airflow's to answer (404).
    assert (why is None) == all(owner in (user, None) for owner in runs.values())


def test_what_names_no_single_product_run_is_for_admins_and_other_dags_are_airflows():
    never = lambda *_: pytest.fail("no owner to look up")  # noqa: E731
    assert "for admins" in refusal("alice", [Target(BATCH, None)], never)
    assert "names no DAG" in refusal("alice", [Target(WILDCARD, None)], never)
    assert refusal("alice", [Target("alices_own_dag", None), Target("other", "r")], never) is None


# -- the middleware in front of Airflow's own API, on runs the batch API triggered -----------------


def _run_of_a_job(client, creds) -> tuple[str, str]:
    """(job id, run id) of a new job of alice's, its run triggered by the batch API."""
    from tests.api.conftest import dag_run_of

    made = client.post("/v1/jobs", headers=creds.key("alice"), json={
        "requests": [{"custom_id": "a", "body": {"messages": [{"role": "user", "content": "hi"}]}}],
        "model": "tiny-random-llama", "labels": {"guard": uuid.uuid4().hex[:8]}})
    assert made.status_code == 200, made.text
    return made.json()["id"], dag_run_of(made.json()["id"])["run_id"]


def _state(api_store, job_id):
    job = api_store.get_job(job_id)
    return job.status.value, job.status_reason, job.dag_run_id


def test_another_users_change_of_a_batch_run_is_refused_and_the_owners_passes(client, creds, api_store, airflow_api):
    job_id, run_id = _run_of_a_job(client, creds)
    run = f"/api/v2/dags/{BATCH}/dagRuns/{run_id}"
    before = airflow_api.get(run, headers=creds.jwt("root")).json()
    job_before = _state(api_store, job_id)
    refused = [
        ("PATCH", run, {"state": "failed"}), ("PATCH", run, {"note": "mine now"}), ("DELETE", run, None),
        ("POST", f"{run}/clear", {"dry_run": False}),
        ("POST", f"/api/v2/dags/{BATCH}/clearTaskInstances", {"dag_run_id": run_id, "dry_run": False}),
        ("POST", f"/api/v2/dags/{BATCH}/clearTaskInstances", {"dry_run": False, "only_failed": False}),
        ("PATCH", f"/api/v2/dags/{BATCH}/dagRuns",
         {"actions": [{"action": "update", "entities": [{"dag_run_id": run_id, "state": "failed"}]}]}),
        ("PATCH", "/api/v2/dags/~/dagRuns",
         {"actions": [{"action": "delete", "entities": [{"dag_id": BATCH, "dag_run_id": run_id}]}]}),
        ("PATCH", f"{run}/taskInstances/prepare", {"new_state": "failed"}),
        ("PATCH", f"/api/v2/dags/{BATCH}", {"is_paused": True}),
    ]
    for user in ("bob", "vic"):
        for method, path, body in refused:
            answer = airflow_api.request(method, path, headers=creds.jwt(user), json=body)
            assert answer.status_code == 403, (user, method, path, answer.text)
            assert "detail" in answer.json() and ("another user's batch job" in answer.json()["detail"]
                                                  or "for admins" in answer.json()["detail"]), answer.text
    after = airflow_api.get(run, headers=creds.jwt("root")).json()
    assert (after["state"], after["note"]) == (before["state"], before["note"])
    assert _state(api_store, job_id) == job_before

    # The owner annotates her run; the admin too; Airflow's own rules answer the rest.
    mine = airflow_api.patch(run, headers=creds.jwt("alice"), json={"note": "alice's note"})
    assert mine.status_code == 200 and mine.json()["note"] == "alice's note", mine.text
    admins = airflow_api.patch(run, headers=creds.jwt("root"), json={"note": "root's note"})
    assert admins.status_code == 200 and admins.json()["note"] == "root's note", admins.text
    assert airflow_api.patch(run, json={"note": "x"}).status_code == 401  # no token: Airflow's answer
    forged = airflow_api.patch(run, headers={"Authorization": "Bearer not.a.token"}, json={"note": "x"})
    assert forged.status_code in (401, 403) and "another user's" not in forged.text


def test_a_users_own_run_may_be_ended_by_her(client, creds, api_store, airflow_api):
    job_id, run_id = _run_of_a_job(client, creds)
    ended = airflow_api.patch(f"/api/v2/dags/{BATCH}/dagRuns/{run_id}", headers=creds.jwt("alice"),
                              json={"state": "failed"})
    assert ended.status_code == 200 and ended.json()["state"] == "failed", ended.text


def test_an_unknown_run_of_the_batch_dag_is_airflows_404(creds, airflow_api):
    answer = airflow_api.patch(f"/api/v2/dags/{BATCH}/dagRuns/no_such_run", headers=creds.jwt("bob"),
                               json={"note": "x"})
    assert answer.status_code == 404, answer.text


def test_the_owner_of_a_form_run_is_whoever_triggered_it_until_it_registers(creds, airflow_api):
    made = airflow_api.post(f"/api/v2/dags/{BATCH}/dagRuns", headers=creds.jwt("bob"),
                            json={"logical_date": None, "conf": {"model": "tiny-random-llama", "input_requests": [
                                {"custom_id": "a", "body": {"messages": [{"role": "user", "content": "hi"}]}}]}})
    assert made.status_code == 200, made.text
    run_id = made.json()["dag_run_id"]
    assert run_guard.owner_of_run(BATCH, run_id) == "bob"
    assert run_guard.owner_of_run("recurring__nightly", run_id) == ADMINS_ONLY
    refused = airflow_api.patch(f"/api/v2/dags/{BATCH}/dagRuns/{run_id}", headers=creds.jwt("alice"),
                                json={"state": "failed"})
    assert refused.status_code == 403, refused.text
    assert airflow_api.patch(f"/api/v2/dags/{BATCH}/dagRuns/{run_id}", headers=creds.jwt("bob"),
                             json={"state": "failed"}).status_code == 200


def test_a_readers_answers_cut_another_owners_batch_conf_to_its_job_id(creds, airflow_api):
    """A form run's conf holds what its user wrote: another reader (viewer or user) sees its
    job id only, in the run, the lists and the batch list, and not the event log's copy, gzip
    asked for or not."""
    secret = f"secret prompt {uuid.uuid4().hex[:8]}"
    made = airflow_api.post(f"/api/v2/dags/{BATCH}/dagRuns", headers=creds.jwt("bob"), json={
        "logical_date": None, "conf": {"model": "tiny-random-llama", "input_requests": [
            {"custom_id": "a", "body": {"messages": [{"role": "user", "content": secret}]}}]}})
    assert made.status_code == 200, made.text
    run_id = made.json()["dag_run_id"]
    # Newest first: the session's other tests made runs of the same DAG before this one.
    reads = [("GET", f"/api/v2/dags/{BATCH}/dagRuns/{run_id}", None),
             ("GET", f"/api/v2/dags/{BATCH}/dagRuns", None), ("GET", "/api/v2/dags/~/dagRuns", None),
             ("POST", "/api/v2/dags/~/dagRuns/list", {"dag_ids": [BATCH], "page_limit": 100, "order_by": "-id"})]
    for user in ("alice", "vic", "bob", "root"):
        for method, path, body in reads:
            answer = airflow_api.request(method, path, json=body,
                                         params={"limit": 100, "order_by": "-id"} if method == "GET" else None,
                                         headers={**creds.jwt(user), "Accept-Encoding": "gzip"})
            assert answer.status_code == 200, (user, path, answer.text)
            runs = answer.json().get("dag_runs", [answer.json()])
            seen = next(r["conf"] for r in runs if r["dag_run_id"] == run_id)
            if user in ("bob", "root"):
                assert secret in str(seen), (user, path)
            else:
                assert seen == {"job_id": run_job_id(made.json()["conf"], run_id)} and secret not in answer.text
    # Airflow's event log records the trigger's body: its extra is bob's (and the admin's) to read.
    for user in ("alice", "vic", "bob", "root"):
        # Newest first: the session's other tests logged events of the same DAG before this one.
        events = airflow_api.get("/api/v2/eventLogs", params={"dag_id": BATCH, "limit": 100, "order_by": "-id"},
                                 headers={**creds.jwt(user), "Accept-Encoding": "gzip"})
        assert events.status_code == 200, events.text
        assert (secret in events.text) == (user in ("bob", "root")), user


def test_hide_confs_leaves_other_dags_and_the_readers_own_runs():
    runs = {"dag_runs": [{"dag_id": BATCH, "dag_run_id": "r1", "conf": {"input_uri": "/x", "job_id": "j1"}},
                         {"dag_id": BATCH, "dag_run_id": "r2", "conf": {"input_uri": "/y"}},
                         {"dag_id": "mine", "dag_run_id": "r3", "conf": {"input_uri": "/z"}}]}
    owners = {"r1": "bob", "r2": "alice"}
    shown = run_guard.hide_confs(runs, "alice", lambda run: owners[run["dag_run_id"]])
    assert [r["conf"] for r in shown["dag_runs"]] == [{"job_id": "j1"}, {"input_uri": "/y"}, {"input_uri": "/z"}]


@hypothesis_settings(max_examples=examples(25), deadline=None)
@given(route=st.sampled_from(RUN_WRITES))
def test_no_route_under_another_users_run_gets_through(route):
    """The middleware alone, over a stand-in for Airflow: nothing reaches it."""
    import asyncio

    reached = []

    async def airflow(scope, receive, send):
        reached.append(scope["path"])

    class User:
        role = "user"

        def get_name(self):
            return "bob"

    async def verified(_scope):
        return User()

    guard = run_guard.RunOwnerGuard(airflow, owner_of=lambda _dag, _run: "alice", user_of=verified)
    sent = []

    async def send(message):
        sent.append(message)

    async def receive():
        return {"type": "http.request", "body": b"{}", "more_body": False}

    method, tail = route
    scope = {"type": "http", "method": method, "path": f"/api/v2/dags/{BATCH}/dagRuns/r1{tail}", "headers": [],
             "query_string": b"", "root_path": ""}
    asyncio.run(guard(scope, receive, send))
    assert reached == [] and sent[0]["status"] == 403
