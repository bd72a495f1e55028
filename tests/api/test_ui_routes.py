"""The Batch jobs page's routes (/batch/ui/...): the page and its assets, its JSON with the
API's ownership rules, the cancel's CSRF rule, and /batch/docs without a CDN.

Users of tests/api/conftest.py: alice and bob (user), vic (viewer), root (admin).
"""

from __future__ import annotations

import re
import uuid

import pytest

from llm_batch.infra import storage
from llm_batch.pipeline.steps import layout_of

pytestmark = pytest.mark.airflow

CHAT = "/v1/chat/completions"


def cookie(creds, user: str) -> dict[str, str]:
    return {"Cookie": f"_token={creds.tokens[user]}"}


@pytest.fixture
def tag() -> str:
    return uuid.uuid4().hex[:8]


@pytest.fixture
def running(api_store, tag):
    """A running job of alice with two shards reporting, and a label of this test."""
    api_store.history_interval_s = 0
    job = api_store.create_job(dialect="openai", endpoint=CHAT, model=f"ui-model-{tag}", owner="alice",
                               labels={"suite": tag})
    api_store.set_counts(job.id, total=40)
    api_store.transition(job.id, "VALIDATING")
    api_store.transition(job.id, "RUNNING")
    api_store.set_dag_run(job.id, f"run-{tag}")
    api_store.report_shard(job.id, 0, state="running", total=20, done=5, succeeded=5, completion_tokens=100,
                           engine_seconds=4.0)
    api_store.report_shard(job.id, 1, state="running", total=20, done=8, succeeded=6, failed=2,
                           completion_tokens=50, engine_seconds=5.0)
    yield api_store.get_job(job.id)
    api_store.history_interval_s = 5.0


def test_page_and_assets_are_served_from_the_package(client):
    page = client.get("/ui/jobs")
    assert page.status_code == 200 and "text/html" in page.headers["content-type"]
    assets = re.findall(r'(?:src|href)="([^"]+)"', page.text)
    assert assets and all(not a.startswith(("http:", "https:", "//")) for a in assets)  # nothing from the internet
    for name in ("jobs.js", "jobs.css", "icon.svg"):
        assert client.get(f"/ui/static/{name}").status_code == 200
    assert client.get("/ui/static/../app.py").status_code == 404


def test_session_names_the_user_and_hands_a_header_token(client, creds):
    alice = client.get("/ui/api/session", headers=cookie(creds, "alice")).json()
    assert (alice["user"], alice["is_admin"], alice["can_submit"]) == ("alice", False, True)
    assert alice["token"] and alice["token"] != creds.tokens["alice"]
    # The token is a working Airflow JWT of the same user.
    again = client.get("/ui/api/session", headers={"Authorization": f"Bearer {alice['token']}"}).json()
    assert again["user"] == "alice"
    vic = client.get("/ui/api/session", headers=cookie(creds, "vic")).json()
    assert (vic["user"], vic["can_submit"]) == ("vic", False)
    assert client.get("/ui/api/session").status_code == 401


def test_list_shows_progress_and_follows_ownership(client, creds, running, tag):
    mine = client.get("/ui/api/jobs", params={"label": f"suite={tag}"}, headers=cookie(creds, "alice")).json()
    (row,) = mine["jobs"]
    assert row["id"] == running.id and row["status"] == "RUNNING"
    assert (row["total"], row["completed"], row["succeeded"], row["failed"]) == (40, 13, 11, 2)
    assert row["tokens_per_s"] == 35.0 and row["owner"] == "alice" and row["labels"] == {"suite": tag}
    assert row["can_cancel"] is True and row["ended_at"] is None
    assert client.get("/ui/api/jobs", params={"label": f"suite={tag}"}, headers=cookie(creds, "bob")).json()["jobs"] == []
    assert client.get("/ui/api/jobs", params={"owner": "alice"}, headers=cookie(creds, "bob")).json()["jobs"] == []
    root = client.get("/ui/api/jobs", params={"model": f"ui-model-{tag}"}, headers=cookie(creds, "root")).json()
    assert [j["id"] for j in root["jobs"]] == [running.id] and root["total"] == 1
    assert root["jobs"][0]["can_cancel"] is True  # admins cancel anyone's job
    assert client.get("/ui/api/jobs", params={"status": "SUCCEEDED", "model": f"ui-model-{tag}"},
                      headers=cookie(creds, "root")).json()["jobs"] == []
    assert client.get("/ui/api/jobs", params={"label": "no-equals"}, headers=cookie(creds, "alice")).status_code == 400


def test_keyset_paging_walks_every_job_once(client, creds, api_store, tag):
    ids = {api_store.create_job(dialect="openai", endpoint=CHAT, model=f"page-{tag}", owner="alice").id
           for _ in range(7)}
    seen, after = [], None
    while True:
        params = {"model": f"page-{tag}", "limit": 3, **({"after": after} if after else {})}
        page = client.get("/ui/api/jobs", params=params, headers=cookie(creds, "alice")).json()
        assert page["total"] == 7
        seen += [j["id"] for j in page["jobs"]]
        after = page["next_after"]
        if after is None:
            break
    assert len(seen) == 7 and set(seen) == ids
    assert client.get("/ui/api/jobs", params={"after": "nope"}, headers=cookie(creds, "alice")).status_code == 400


def test_detail_has_shards_history_links_and_error_lines(client, creds, running, batch_api, api_store):
    settings = batch_api.state.llm_batch.settings
    uri = layout_of(settings, running.id).errors_jsonl
    # An OpenAI-shaped error line (the error under response.body), a plain one, and junk.
    lines = [b'{"custom_id": "r0", "line": 1, "response": {"status_code": 500, "body": {"error": {"message": "engine died", '
             b'"code": "engine_error"}}}, "error": null}\n', b'not json <b>\n']
    lines += [b'{"custom_id": "r%d", "line": %d, "error": {"message": "bad", "code": "invalid_body"}}\n' % (i, i + 1)
              for i in range(2, 30)]
    storage.write_bytes(uri, b"".join(lines))
    errors = api_store.create_file(owner="alice", purpose="batch_output", filename="errors.jsonl", bytes=1,
                                   uri=uri, kind="error", job_id=running.id)
    api_store.set_outputs(running.id, error_file_id=errors.id)
    detail = client.get(f"/ui/api/jobs/{running.id}", headers=cookie(creds, "alice")).json()
    assert [(s["shard"], s["state"], s["done"], s["total"], s["tokens_per_s"]) for s in detail["shards"]] == [
        (0, "running", 5, 20, 25.0), (1, "running", 8, 20, 10.0)]
    assert [p["completed"] for p in detail["history"]] == [5, 13, 13]  # two reports, then the job now
    assert detail["links"]["run"] == f"/dags/batch_inference/runs/{running.dag_run_id}"
    # The error table's rows: line, custom_id, code, message (an unparsable line as its text).
    assert len(detail["error_lines"]) == 20
    assert detail["error_lines"][0] == {"line": 1, "custom_id": "r0", "code": "engine_error", "message": "engine died"}
    assert detail["error_lines"][1] == {"line": None, "custom_id": None, "code": None, "message": "not json <b>"}
    assert detail["error_lines"][2] == {"line": 3, "custom_id": "r2", "code": "invalid_body", "message": "bad"}
    assert detail["error_file_id"] == errors.id
    assert client.get(f"/ui/api/jobs/{running.id}", headers=cookie(creds, "bob")).status_code == 404


def test_an_ended_job_shows_the_rate_its_engines_ran_at(client, creds, running, api_store):
    """Live: the running shards' tokens per engine second (the store's). Ended: what its engines
    generated over the time they ran (the merge's figure, steps.engine_rate): not 0 because no
    shard runs any more, not diluted by the engine's start."""
    from llm_batch.pipeline.steps import engine_rate

    assert client.get(f"/ui/api/jobs/{running.id}", headers=cookie(creds, "alice")).json()["tokens_per_s"] == 35.0
    rate = engine_rate(api_store.shard_records(running.id))
    assert rate == round(150 / 9.0, 1)
    api_store.set_usage(running.id, prompt_tokens=0, completion_tokens=150, cached_prompt_tokens=None,
                        reasoning_tokens=0, tokens_per_s=rate)
    api_store.transition(running.id, "FINALIZING")
    api_store.transition(running.id, "SUCCEEDED")
    assert client.get(f"/ui/api/jobs/{running.id}", headers=cookie(creds, "alice")).json()["tokens_per_s"] == rate


def test_cancel_owner_admin_viewer_and_csrf(client, creds, running, api_store):
    url = f"/ui/api/jobs/{running.id}/cancel"
    # The cookie alone never cancels (a cross-site form could send it).
    assert client.post(url, headers=cookie(creds, "alice")).status_code == 403
    vic_token = client.get("/ui/api/session", headers=cookie(creds, "vic")).json()["token"]
    viewer = client.post(url, headers={"Authorization": f"Bearer {vic_token}"})
    assert viewer.status_code == 403
    assert client.post(url, headers=creds.jwt("bob")).status_code == 404  # not bob's: not found
    assert api_store.get_job(running.id).cancel_requested_at is None
    token = client.get("/ui/api/session", headers=cookie(creds, "alice")).json()["token"]
    done = client.post(url, headers={"Authorization": f"Bearer {token}"})
    assert done.status_code == 200 and done.json()["status"] == "CANCELLING" and done.json()["can_cancel"] is False
    assert client.post(url, headers=creds.jwt("root")).status_code == 200  # admins too; idempotent


def test_docs_load_nothing_from_a_cdn(client):
    docs = client.get("/docs")
    assert docs.status_code == 200
    urls = re.findall(r"""(?:src|href)=["']([^"']+)["']|url: ?['"]([^'"]+)['"]""", docs.text)
    flat = [u for pair in urls for u in pair if u]
    assert flat and not [u for u in flat if u.startswith(("http:", "https:", "//"))], flat
    assert "/batch/docs/assets/swagger-ui-bundle.js" in flat and "/batch/openapi.json" in flat
    for asset in ("swagger-ui-bundle.js", "swagger-ui.css", "favicon-32x32.png"):
        assert client.get(f"/docs/assets/{asset}").status_code == 200
    assert client.get("/docs/oauth2-redirect").status_code == 200


def test_detail_previews_the_first_results_of_every_shape(client, creds, running, batch_api, api_store):
    settings = batch_api.state.llm_batch.settings
    uri = layout_of(settings, running.id).output_jsonl
    chat = b'{"custom_id": "c0", "response": {"status_code": 200, "body": {"choices": [{"message": {"content": "  two\\n words "}}]}}}\n'
    completion = b'{"custom_id": "c1", "response": {"body": {"choices": [{"text": "x\\u0000\\u200b" }]}}}\n'
    embedding = b'{"custom_id": "c2", "response": {"body": {"data": [{"embedding": [0.1, 0.2, 0.3]}]}}}\n'
    other = b'{"custom_id": "c3", "response": {"body": {"results": [{"flagged": false}]}}}\n'
    long = b'{"custom_id": "c4", "response": {"body": {"choices": [{"text": "' + b"y" * 5000 + b'"}]}}}\n'
    storage.write_bytes(uri, chat + completion + embedding + other + long + b"not json <b>\n")
    output = api_store.create_file(owner="alice", purpose="batch_output", filename="out.jsonl", bytes=1,
                                   uri=uri, kind="output", job_id=running.id)
    api_store.set_outputs(running.id, output_file_id=output.id)
    preview = client.get(f"/ui/api/jobs/{running.id}", headers=cookie(creds, "alice")).json()["preview"]
    assert len(preview) == 5  # the first five lines only
    assert preview[0] == {"custom_id": "c0", "answer": "two words"}
    assert preview[1] == {"custom_id": "c1", "answer": "x\ufffd\ufffd"}  # invisible characters made visible
    assert preview[2] == {"custom_id": "c2", "answer": "embedding of 3 numbers"}
    assert preview[3] == {"custom_id": "c3", "answer": '{"results":[{"flagged":false}]}'}
    assert preview[4]["custom_id"] == "c4" and len(preview[4]["answer"]) == 300 and preview[4]["answer"].endswith("…")
    from llm_batch.api.routers.ui import result_row

    blank = '{"custom_id": "e", "response": {"body": {"choices": [{"message": {"content": " \\n "}}]}}}'
    assert result_row(blank) == {"custom_id": "e", "answer": "(empty)"}  # not a cell that looks like no answer


def test_search_finds_a_job_by_id_prefix_and_label(client, creds, running, tag):
    by_id = client.get("/ui/api/jobs", params={"q": running.id[:12]}, headers=cookie(creds, "alice")).json()
    assert running.id in [j["id"] for j in by_id["jobs"]]
    by_label = client.get("/ui/api/jobs", params={"q": tag}, headers=cookie(creds, "alice")).json()
    assert [j["id"] for j in by_label["jobs"]] == [running.id]
    assert client.get("/ui/api/jobs", params={"q": tag}, headers=cookie(creds, "bob")).json()["jobs"] == []
    assert client.get("/ui/api/jobs", params={"q": "a\x00b"}, headers=cookie(creds, "alice")).status_code == 422


def test_an_ended_job_offers_retry_and_run_again_to_its_owner_only(client, creds, running, api_store):
    live = client.get(f"/ui/api/jobs/{running.id}", headers=cookie(creds, "alice")).json()
    assert (live["can_retry"], live["can_rerun"], live["derived_from"]) == (False, False, None)
    api_store.transition(running.id, "FINALIZING")
    api_store.transition(running.id, "SUCCEEDED")
    ended = client.get(f"/ui/api/jobs/{running.id}", headers=cookie(creds, "alice")).json()
    assert ended["can_retry"] is True  # two lines failed
    assert ended["can_rerun"] is True and ended["queue"] is None
    viewer = client.get(f"/ui/api/jobs/{running.id}", headers=cookie(creds, "root")).json()
    assert viewer["can_rerun"] is True  # an admin may
