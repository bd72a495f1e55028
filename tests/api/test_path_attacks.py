"""Every user-path field of the API, tried by an attacker against a generated list of
protected targets: the job store's own files, key files, Airflow's home, the work, files and
model areas, another owner's inputs and outputs, in every spelling (symlinks, ``..``, case,
trailing dots, ``file://``, percent-encoding, hard links), locally and on the real S3
server. Each must be refused with a 4xx before anything runs; afterwards the store's files
and the other owner's files are byte-identical, and no job was made.

The reproductions of the security report are here too: output_data_path = jobs.db-wal (the
store was corrupted), one owner overwriting or reading another's Scale files, and the
existence oracle of "does not exist".
"""

from __future__ import annotations

import hashlib
import os
import sqlite3
from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest

from llm_batch.core.config import Settings, get_settings
from tests.api.conftest import app_on, mounted, simulate_run
from tests.fuzzing import examples

pytestmark = pytest.mark.airflow

SCALE = "/v2/batch-completions"
MODEL = {"model": "tiny-random-llama"}
USER_PATH_FIELDS = ("input_data_path", "output_data_path", "model_config.checkpoint_path")


def _spellings(path: str) -> list[str]:
    parent, name = os.path.split(path)
    return [path, f"file://{path}", path.upper(), f"{path}.", f"{parent}/./{name}", f"{parent}//{name}",
            f"file://{parent}/%{ord(name[0]):02x}{name[1:]}", f"{parent}/../{os.path.basename(parent)}/{name}"]


def _body(field: str, target: str, own: Path) -> dict:
    """A Scale create whose `field` names `target` and whose other paths are the caller's own."""
    body = {"input_data_path": str(own / "in.json"), "output_data_path": str(own / "out-new.json"), "model_config": dict(MODEL)}
    if field == "model_config.checkpoint_path":
        body["model_config"]["checkpoint_path"] = target
    else:
        body[field] = target
    return body


def _fingerprint(paths: list[Path]) -> dict[str, str | None]:
    return {str(p): hashlib.sha256(p.read_bytes()).hexdigest() if p.exists() else None for p in paths}


@pytest.fixture()
def owners(client, creds, api_store, llm_batch_home) -> Iterator[dict]:
    """alice's folder with an input; bob's finished Scale job with its input and output."""
    data = llm_batch_home / "data"
    alice, bob = data / "alice", data / "bob"
    for folder in (alice, bob):
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "in.json").write_bytes(orjson.dumps([{"prompt": "hi", "max_tokens": 2}] * 3))
    bob_out = bob / f"out-{os.urandom(4).hex()}.json"
    created = client.post(SCALE, headers=creds.key("bob"),
                          json={"input_data_path": str(bob / "in.json"), "output_data_path": str(bob_out), "model_config": MODEL})
    assert created.status_code == 200, created.text
    for _ in simulate_run(api_store, created.json()["job_id"], ok=3, failed=0):
        pass
    assert bob_out.is_file()
    yield {"alice": alice, "bob": bob, "bob_output": bob_out, "bob_job": created.json()["job_id"]}


def protected_targets(settings: Settings, bob: Path, bob_output: Path) -> list[str]:
    """What alice must never name: generated from the home as it is, plus what is not there
    yet but would be state if written (the -journal, the key file)."""
    home = settings.home
    db = Path(settings.database_url.removeprefix("sqlite:///"))
    named = [db, Path(f"{db}-wal"), Path(f"{db}-shm"), Path(f"{db}-journal"), home / "api-key",
             home / "airflow" / "airflow.db", Path(settings.work_uri) / "job_x" / "output.jsonl",
             Path(settings.files_uri) / "file-x", Path(settings.model_cache) / "tiny-random-llama" / "config.json",
             bob / "in.json", bob_output]
    existing = sorted(p for p in home.rglob("*") if p.is_file() and not p.is_relative_to(home / "data" / "alice"))
    # A sample of everything else under the home (the work area alone holds thousands of files):
    # 40 in the whole suite, fewer in the quick lane (tests/fuzzing.py).
    return sorted({str(p) for p in named} | {str(p) for p in existing[:: max(1, len(existing) // examples(40))]})


def test_no_user_path_field_reaches_a_protected_target(client, creds, api_store, owners, llm_batch_home):
    settings = get_settings()
    targets = protected_targets(settings, owners["bob"], owners["bob_output"])
    db = Path(settings.database_url.removeprefix("sqlite:///"))
    with sqlite3.connect(db) as connection:  # the store's state all in jobs.db: a write would show
        connection.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    watched = [db, Path(f"{db}-wal"), owners["bob"] / "in.json", owners["bob_output"]]
    before = _fingerprint(watched)
    jobs_before = api_store.list_jobs(owner="alice", limit=1)[1]

    answers: dict[int, int] = {}
    for target in targets:
        for spelled in _spellings(target):
            for field in USER_PATH_FIELDS:
                response = client.post(SCALE, headers=creds.key("alice"), json=_body(field, spelled, owners["alice"]))
                answers[response.status_code] = answers.get(response.status_code, 0) + 1
                assert 400 <= response.status_code < 500, (field, spelled, response.status_code, response.text)
                assert response.json()["param"] == field, (field, spelled, response.text)

    assert len(targets) >= 11 and sum(answers.values()) >= len(targets) * 8 * 3
    assert api_store.list_jobs(owner="alice", limit=1)[1] == jobs_before  # nothing was made
    assert _fingerprint(watched) == before  # nothing was written


def test_symlinks_and_hard_links_from_the_own_folder_are_refused(client, creds, owners, llm_batch_home):
    settings = get_settings()
    alice = owners["alice"]
    db = settings.database_url.removeprefix("sqlite:///")
    links = {"to-wal": f"{db}-wal", "to-bob-out": str(owners["bob_output"]), "to-bob": str(owners["bob"]), "to-home": str(llm_batch_home)}
    for name, target in links.items():
        link = alice / f"{name}-{os.urandom(3).hex()}"
        link.symlink_to(target)
        for field in USER_PATH_FIELDS:
            for spelled in (str(link), str(link / "x.json"), str(link / "jobs.db-wal")):
                response = client.post(SCALE, headers=creds.key("alice"), json=_body(field, spelled, alice))
                assert 400 <= response.status_code < 500 and response.json()["param"] == field, (field, spelled, response.text)
    hard = alice / f"hard-{os.urandom(3).hex()}.json"
    source = owners["bob"] / f"{hard.name}.src"
    source.write_bytes((owners["bob"] / "in.json").read_bytes())
    os.link(source, hard)
    response = client.post(SCALE, headers=creds.key("alice"), json=_body("input_data_path", str(hard), alice))
    assert response.status_code == 400 and response.json()["code"] == "path_unavailable"


def test_the_reported_store_corruption_is_refused(client, creds, owners):
    """Was 200, and the merge replaced jobs.db-wal with a JSON array."""
    settings = get_settings()
    db = settings.database_url.removeprefix("sqlite:///")
    for target in (f"{db}-wal", f"{db}-shm", str(settings.home / "api-key")):
        response = client.post(SCALE, headers=creds.key("alice"),
                               json={"content": [{"prompt": "x", "max_tokens": 2}], "output_data_path": target, "model_config": MODEL})
        assert response.status_code == 400, response.text
        assert response.json()["param"] == "output_data_path"
        # Not even an admin may name the store's files.
        admin = client.post(SCALE, headers=creds.key("admin-key"),
                            json={"content": [{"prompt": "x", "max_tokens": 2}], "output_data_path": target, "model_config": MODEL})
        assert admin.status_code == 400, admin.text


def test_one_owner_cannot_overwrite_or_read_anothers_scale_files(client, creds, owners):
    """Were accepted: bob's job overwrote alice's results, and ran on alice's prompts."""
    bob_output_bytes = owners["bob_output"].read_bytes()
    overwrite = client.post(SCALE, headers=creds.key("alice"),
                            json={"content": [{"prompt": "x", "max_tokens": 2}], "output_data_path": str(owners["bob_output"]), "model_config": MODEL})
    assert overwrite.status_code == 400 and "namespace" in overwrite.json()["detail"]
    read = client.post(SCALE, headers=creds.key("alice"), json=_body("input_data_path", str(owners["bob"] / "in.json"), owners["alice"]))
    assert read.status_code == 400 and "namespace" in read.json()["detail"]
    assert owners["bob_output"].read_bytes() == bob_output_bytes


def test_an_output_never_replaces_a_file_its_owners_jobs_did_not_write(client, creds, api_store, owners):
    bob = creds.key("bob")
    inline = {"content": [{"prompt": "x", "max_tokens": 2}], "model_config": MODEL}
    # bob's own input file, and bob's earlier job's output.
    response = client.post(SCALE, headers=bob, json={**inline, "output_data_path": str(owners["bob"] / "in.json")})
    assert response.status_code == 409 and response.json()["code"] == "output_exists", response.text
    again = client.post(SCALE, headers=bob, json={**inline, "output_data_path": str(owners["bob_output"])})
    assert again.status_code == 409 and "overwrite-output" in again.json()["detail"]
    allowed = client.post(SCALE, headers=bob, json={**inline, "output_data_path": str(owners["bob_output"]),
                                                    "labels": {"llm-batch.io/overwrite-output": "true"}})
    assert allowed.status_code == 200, allowed.text
    # Two live jobs writing one file: the second is refused.
    twin = client.post(SCALE, headers=bob, json={**inline, "output_data_path": str(owners["bob_output"]),
                                                 "labels": {"llm-batch.io/overwrite-output": "true"}})
    assert twin.status_code == 409 and twin.json()["code"] == "output_in_use"
    # An admin's job may not replace bob's output either (no job of the admin wrote it).
    admin = client.post(SCALE, headers=creds.key("admin-key"), json={**inline, "output_data_path": str(owners["bob"] / "in.json")})
    assert admin.status_code == 409


def test_missing_and_hidden_inputs_get_the_same_answer(client, creds, owners):
    alice = owners["alice"]
    link = alice / f"hidden-{os.urandom(3).hex()}.json"
    link.symlink_to(owners["bob"] / "in.json")
    missing = alice / f"missing-{os.urandom(3).hex()}.json"
    answers = []
    for path in (link, missing):
        response = client.post(SCALE, headers=creds.key("alice"), json=_body("input_data_path", str(path), alice))
        assert response.status_code == 400
        answers.append((response.json()["code"], response.json()["detail"].replace(str(path), "PATH")))
    assert answers[0] == answers[1]


def test_relative_paths_are_the_callers_own(client, creds, api_store, owners):
    response = client.post(SCALE, headers=creds.key("alice"),
                           json={"input_data_path": "in.json", "output_data_path": f"rel/{os.urandom(3).hex()}.json", "model_config": MODEL})
    assert response.status_code == 200, response.text
    job = api_store.get_job(response.json()["job_id"])
    assert job.input.uri == str(owners["alice"] / "in.json")
    assert job.array_output_uri.startswith(str(owners["alice"]) + "/rel/")


@pytest.mark.s3
def test_s3_paths_are_confined_to_the_owners_prefix_and_never_internal(
    creds, api_store, s3_server, s3_bucket, auth_manager, airflow_dags_in_db
):
    from fastapi.testclient import TestClient

    s3 = s3_server.client()
    for key in ("alice/in.json", "bob/in.json", "bob/out.json", "llm-batch/work/job_x/output.jsonl", "llm-batch/files/file-x"):
        s3.put_object(Bucket=s3_bucket, Key=key, Body=orjson.dumps([{"prompt": "hi", "max_tokens": 2}]))
    settings = get_settings().model_copy(update={
        "allowed_buckets": [s3_bucket], "work_uri": f"s3://{s3_bucket}/llm-batch/work", "files_uri": f"s3://{s3_bucket}/llm-batch/files",
    })
    outer = mounted(app_on(api_store, auth_manager, settings), auth_manager)
    before = {key: s3.get_object(Bucket=s3_bucket, Key=key)["Body"].read() for key in ("bob/in.json", "bob/out.json")}
    own_in, own_out = f"s3://{s3_bucket}/alice/in.json", f"s3://{s3_bucket}/alice/out-{os.urandom(3).hex()}.json"
    targets = [f"s3://{s3_bucket}/{key}" for key in ("bob/in.json", "bob/out.json", "llm-batch/work/job_x/output.jsonl",
                                                     "llm-batch/files/file-x", "llm-batch/WORK/x", "in.json")]
    targets += [f"s3://{s3_bucket}/alice/../bob/in.json", f"s3://{s3_bucket}/alice//x", f"s3://{s3_bucket}/alice/./x",
                "s3://another-bucket/alice/x"]
    with TestClient(outer, base_url="http://testserver/batch", raise_server_exceptions=False) as client:
        for target in targets:
            for field in ("input_data_path", "output_data_path"):
                body = {"input_data_path": own_in, "output_data_path": own_out, "model_config": MODEL, field: target}
                response = client.post(SCALE, headers=creds.key("alice"), json=body)
                assert response.status_code == 400 and response.json()["param"] == field, (field, target, response.text)
        accepted = client.post(SCALE, headers=creds.key("alice"), json={"input_data_path": own_in, "output_data_path": own_out, "model_config": MODEL})
        assert accepted.status_code == 200, accepted.text
    assert {key: s3.get_object(Bucket=s3_bucket, Key=key)["Body"].read() for key in before} == before


# -- per-owner limits ------------------------------------------------------------------------


@pytest.fixture()
def tight_limits(batch_api, monkeypatch):
    """bob's limits lowered on the app's own settings (as an admin sets them)."""
    settings = batch_api.state.llm_batch.settings
    monkeypatch.setattr(settings, "owner_limits", {"bob": {"max_live_jobs": 0, "max_requests_in_flight": 5, "max_file_bytes": 0}})
    return settings


def test_per_owner_limits_answer_429_naming_the_limit(client, creds, api_store, tight_limits, monkeypatch):
    bob, inline = creds.key("bob"), {"model_config": MODEL, "output_data_path": f"lim/{os.urandom(3).hex()}.json"}
    too_many = client.post(SCALE, headers=bob, json={**inline, "content": [{"prompt": "x", "max_tokens": 2}] * 6})
    assert too_many.status_code == 429 and too_many.json()["param"] == "max_requests_in_flight", too_many.text
    assert "limit 5" in too_many.json()["detail"]

    first = client.post(SCALE, headers=bob, json={**inline, "content": [{"prompt": "x", "max_tokens": 2}]})
    assert first.status_code == 200, first.text
    held = api_store.owner_usage("bob")["live_jobs"]
    monkeypatch.setitem(tight_limits.owner_limits["bob"], "max_live_jobs", held)
    full = client.post(SCALE, headers=bob, json={**inline, "output_data_path": "lim/other.json", "content": [{"prompt": "x", "max_tokens": 2}]})
    assert full.status_code == 429 and full.json()["code"] == "limit_exceeded" and full.json()["param"] == "max_live_jobs"
    openai_full = client.post("/v1/batches", headers=bob, json={"input_file_id": "file-x", "endpoint": "/v1/chat/completions", "completion_window": "24h"})
    assert openai_full.status_code == 429 and openai_full.json()["error"]["code"] == "limit_exceeded"

    stored = api_store.owner_usage("bob")["file_bytes"]
    monkeypatch.setitem(tight_limits.owner_limits["bob"], "max_file_bytes", stored + 10)
    upload = client.post("/v1/files", headers=bob, files={"file": ("big.jsonl", b'{"custom_id": "a", "body": {}}\n' * 2)}, data={"purpose": "batch"})
    assert upload.status_code == 429 and upload.json()["error"]["param"] == "max_file_bytes", upload.text
    assert api_store.owner_usage("bob")["file_bytes"] == stored  # nothing kept
    # Others and admins are not held to bob's limits.
    assert client.post(SCALE, headers=creds.key("admin-key"), json={**inline, "content": [{"prompt": "x", "max_tokens": 2}] * 6}).status_code == 200
