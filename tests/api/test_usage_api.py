"""``GET /batch/v1/usage`` (admins: every owner's jobs; others: their own) and ``llm-batch
usage`` against it.

The API's store is shared with the other API tests: each test makes jobs of owners, models
and a label key of its own and reads only their groups.
"""

from __future__ import annotations

import json
import uuid
from datetime import UTC, datetime, timedelta

import pytest

pytestmark = pytest.mark.airflow

CHAT = "/v1/chat/completions"
OLD = datetime(2001, 1, 1, tzinfo=UTC)
FIELDS = {"group", "jobs", "requests", "prompt_tokens", "completion_tokens", "cached_prompt_tokens",
          "reasoning_tokens", "cached_requests", "cached_tokens", "invalid_output", "output_retries", "retry_tokens",
          "engine_seconds", "gpu_seconds"}


@pytest.fixture
def made(api_store) -> dict[str, str]:
    """Two owners of this test: ann has a 2-GPU job now and a job from 2001, ben one job now
    (no gpus named: 1); the label key is the test's own too."""
    tag = uuid.uuid4().hex[:8]
    names = {"ann": f"usage-ann-{tag}", "ben": f"usage-ben-{tag}", "model": f"usage-model-{tag}", "key": f"usage-{tag}"}

    def job(owner: str, created_at: datetime | None, total: int, ok: int, prompt: int, completion: int,
            seconds: float, **fields):
        made = api_store.create_job(dialect="mistral", endpoint=CHAT, model=names["model"], owner=owner,
                                    created_at=created_at, **fields)
        api_store.report_shard(made.id, 0, state="done", total=total, done=total, succeeded=ok, failed=total - ok,
                               prompt_tokens=prompt, completion_tokens=completion, cached_prompt_tokens=prompt // 2,
                               engine_seconds=seconds)
        api_store.set_counts(made.id, total=total)
        return made.id

    first = job(names["ann"], None, 10, 9, 1000, 200, 20.0, labels={names["key"]: "x"}, resources={"gpus": 2})
    # Its failed line failed the output check after 2 retries (40 tokens thrown away).
    api_store.set_usage(first, prompt_tokens=1000, completion_tokens=200, cached_prompt_tokens=500,
                        reasoning_tokens=0, invalid_output=1, output_retries=2, retry_tokens=40)
    job(names["ann"], OLD, 1, 1, 5, 5, 1.0, labels={names["key"]: "y"}, resources={"gpus": 4})
    job(names["ben"], None, 3, 3, 30, 9, 6.0, labels={names["key"]: "x"})
    return names


def _groups(response, prefix: str) -> dict[str, dict]:
    assert response.status_code == 200, response.text
    return {g["group"]: g for g in response.json()["data"] if g["group"].startswith(prefix)}


def test_admin_gets_sums_by_owner(client, creds, made):
    response = client.get("/v1/usage", params={"by": "owner"}, headers=creds.key("admin-key"))
    body = response.json()
    assert (body["object"], body["by"], body["since"]) == ("list", "owner", None)
    groups = _groups(response, "usage-")
    ann, ben = groups[made["ann"]], groups[made["ben"]]
    assert set(ann) == FIELDS
    assert ann == {"group": made["ann"], "jobs": 2, "requests": {"total": 11, "succeeded": 10, "failed": 1},
                   "prompt_tokens": 1005, "completion_tokens": 205, "cached_prompt_tokens": 502,
                   "reasoning_tokens": 0, "cached_requests": 0, "cached_tokens": 0,
                   "invalid_output": 1, "output_retries": 2, "retry_tokens": 40,
                   "engine_seconds": 21.0, "gpu_seconds": 44.0}  # 20 x 2 + 1 x 4
    assert (ben["jobs"], ben["engine_seconds"], ben["gpu_seconds"]) == (1, 6.0, 6.0)
    # An Airflow Admin gets the same report.
    assert _groups(client.get("/v1/usage", params={"by": "owner"}, headers=creds.jwt("root")), "usage-") == groups


def test_since_as_unix_seconds_or_iso_8601(client, creds, made):
    for since in (str(int(datetime(2020, 1, 1, tzinfo=UTC).timestamp())), "2020-01-01", "2020-01-01T01:00:00+01:00"):
        response = client.get("/v1/usage", params={"by": "owner", "since": since}, headers=creds.key("admin-key"))
        assert response.json()["since"] == "2020-01-01T00:00:00Z"
        ann = _groups(response, "usage-")[made["ann"]]
        assert (ann["jobs"], ann["requests"]["total"], ann["gpu_seconds"]) == (1, 10, 40.0)  # the 2001 job is out
    future = (datetime.now(UTC) + timedelta(days=1)).isoformat()
    response = client.get("/v1/usage", params={"by": "model", "since": future}, headers=creds.key("admin-key"))
    assert response.json()["data"] == []


def test_by_model_label_and_all(client, creds, made):
    admin = creds.key("admin-key")
    model = _groups(client.get("/v1/usage", params={"by": "model"}, headers=admin), made["model"])[made["model"]]
    assert (model["jobs"], model["prompt_tokens"], model["gpu_seconds"]) == (3, 1035, 50.0)
    labels = _groups(client.get("/v1/usage", params={"by": "label"}, headers=admin), made["key"])
    assert {g: (v["jobs"], v["requests"]["total"]) for g, v in labels.items()} == {
        f"{made['key']}=x": (2, 13), f"{made['key']}=y": (1, 1)}
    everything = client.get("/v1/usage", headers=admin).json()
    assert everything["by"] is None and [g["group"] for g in everything["data"]] == ["(all)"]
    assert everything["data"][0]["jobs"] >= 3


def test_by_model_splits_a_job_whose_lines_ran_on_several_adapters(client, creds, api_store):
    """A job of the base and two LoRA adapters (its merge's model_usage) counts in each model's
    row: requests and tokens exactly, engine and GPU seconds by token share, failures under
    the job's own model."""
    tag = uuid.uuid4().hex[:8]
    base, a, b = f"usage-base-{tag}", f"usage-lora-a-{tag}", f"usage-lora-b-{tag}"
    made = api_store.create_job(dialect="openai", endpoint=CHAT, model=a, owner="usage-mixed", resources={"gpus": 2})
    api_store.report_shard(made.id, 0, state="done", total=7, done=7, succeeded=6, failed=1, prompt_tokens=60,
                           completion_tokens=60, engine_seconds=12.0)
    api_store.set_counts(made.id, total=7)
    api_store.set_usage(made.id, prompt_tokens=60, completion_tokens=60, cached_prompt_tokens=None, reasoning_tokens=0,
                        model_usage={base: {"succeeded": 1, "prompt_tokens": 10, "completion_tokens": 20},
                                     a: {"succeeded": 2, "prompt_tokens": 20, "completion_tokens": 10},
                                     b: {"succeeded": 3, "prompt_tokens": 30, "completion_tokens": 30}})
    groups = _groups(client.get("/v1/usage", params={"by": "model"}, headers=creds.key("admin-key")), "usage-")
    seen = {g: (v["jobs"], v["requests"]["total"], v["requests"]["succeeded"], v["requests"]["failed"],
                v["prompt_tokens"], v["completion_tokens"], v["engine_seconds"], v["gpu_seconds"])
            for g, v in groups.items() if tag in g}
    # 120 tokens: the base 30 (1/4 of 12 s), a 30 plus the failed line, b 60 (1/2).
    assert seen == {base: (1, 1, 1, 0, 10, 20, 3.0, 6.0), a: (1, 3, 2, 1, 20, 10, 3.0, 6.0),
                    b: (1, 3, 3, 0, 30, 30, 6.0, 12.0)}


@pytest.fixture
def own(api_store) -> dict[str, str]:
    """alice's jobs of a model of this test, and bob's of the same model."""
    model = f"usage-own-{uuid.uuid4().hex[:8]}"
    for owner, prompt in (("alice", 100), ("alice", 20), ("bob", 7000)):
        made = api_store.create_job(dialect="mistral", endpoint=CHAT, model=model, owner=owner, labels={"t": model})
        api_store.report_shard(made.id, 0, state="done", total=2, done=2, succeeded=2, failed=0,
                               prompt_tokens=prompt, completion_tokens=1, cached_prompt_tokens=0, engine_seconds=1.0)
    return {"model": model}


@pytest.mark.parametrize("who", ["alice-key", "alice-jwt"])
def test_non_admins_get_only_their_own_usage_whatever_they_ask(client, creds, own, who):
    headers = {"alice-key": creds.key("alice"), "alice-jwt": creds.jwt("alice")}[who]
    for params in ({"by": "model"}, {"by": "model", "owner": "bob"}, {"by": "model", "owner": ""}):
        response = client.get("/v1/usage", params=params, headers=headers)
        assert response.status_code == 200, response.text
        assert response.json()["owner"] == "alice"
        group = _groups(response, own["model"])[own["model"]]
        assert (group["jobs"], group["prompt_tokens"]) == (2, 120)  # bob's 7000 are not counted
    owners = client.get("/v1/usage", params={"by": "owner"}, headers=headers).json()["data"]
    assert [g["group"] for g in owners] == ["alice"]
    viewer = client.get("/v1/usage", params={"by": "owner"}, headers=creds.jwt("vic"))
    assert viewer.status_code == 200 and {g["group"] for g in viewer.json()["data"]} <= {"vic"}
    assert client.get("/v1/usage").status_code == 401


def test_admins_see_every_owner_or_the_one_they_ask_for(client, creds, own):
    admin = creds.key("admin-key")
    every = client.get("/v1/usage", params={"by": "model"}, headers=admin).json()
    assert every["owner"] is None and _groups_of(every, own["model"])["jobs"] == 3
    bobs = client.get("/v1/usage", params={"by": "model", "owner": "bob"}, headers=admin).json()
    assert bobs["owner"] == "bob" and _groups_of(bobs, own["model"])["prompt_tokens"] == 7000


def _groups_of(report: dict, model: str) -> dict:
    return next(g for g in report["data"] if g["group"] == model)


@pytest.mark.parametrize(
    ("params", "status", "param"),
    [({"by": "team"}, 422, "by"), ({"since": "last tuesday"}, 400, "since"), ({"since": "nan"}, 400, "since"),
     ({"since": "1e300"}, 400, "since"), ({"since": "0001-01-01T00:00:00+01:00"}, 400, "since"),
     ({"since": "9" * 80}, 422, "since")],
)
def test_bad_parameters_are_refused_naming_them(client, creds, params, status, param):
    response = client.get("/v1/usage", params=params, headers=creds.key("admin-key"))
    assert response.status_code == status, response.text
    assert response.json()["param"] == param


def test_the_document_describes_every_field(client):
    document = client.get("/openapi.json").json()
    operation = document["paths"]["/v1/usage"]["get"]
    assert {"200", "400", "401", "422"} <= set(operation["responses"])
    schemas = document["components"]["schemas"]
    for name in ("UsageList", "UsageGroup", "UsageRequests"):
        undescribed = [field for field, spec in schemas[name]["properties"].items() if not spec.get("description")]
        assert not undescribed, (name, undescribed)


def test_cli_prints_the_groups(live_server, creds, made, cli, capsys):
    main = cli(f"{live_server}/batch", creds.keys["admin-key"])
    assert main(["usage", "--by", "owner", "--since", "2020-01-01"]) == 0
    out, err = capsys.readouterr()
    rows = {line.split()[0]: line.split() for line in out.splitlines()[1:]}
    assert out.splitlines()[0].split()[:2] == ["OWNER", "JOBS"]
    assert rows[made["ann"]] == [made["ann"], "1", "10", "9", "1", "1,000", "200", "500", "0", "2", "20.0", "40.0"]
    assert rows[made["ben"]] == [made["ben"], "1", "3", "3", "0", "30", "9", "15", "0", "0", "6.0", "6.0"]
    assert "since 2020-01-01T00:00:00Z" in err

    assert main(["usage", "--by", "label", "--json"]) == 0
    labels = {g["group"]: g["jobs"] for g in json.loads(capsys.readouterr().out)["data"]}
    assert (labels[f"{made['key']}=x"], labels[f"{made['key']}=y"]) == (2, 1)

    main = cli(f"{live_server}/batch", creds.keys["alice"])  # a non-admin: their own jobs
    assert main(["usage", "--by", "owner", "--json"]) == 0
    assert [g["group"] for g in json.loads(capsys.readouterr().out)["data"]] in ([], ["alice"])
