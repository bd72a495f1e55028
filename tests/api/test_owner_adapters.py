"""An owner's own LoRA adapters through ``/v1/adapters``: uploaded as an archive of the two
files, checked against the base model (the tiny random Llama, prepared), seen and usable by
their owner only.

- with the test app: upload, list, get, delete as alice; bob sees nothing of hers (404, not
  in his list); every refusal is a precise 4xx naming its code (an archive member that is
  not admitted, a link, ``..``, a rank above the deployment's, a base that is no generate
  model or is not prepared, a name of the registry's, a malformed or taken name, too big);
  a job naming her adapter as its model is accepted on every route, bob's is unknown_model;
- a real run (dag.test, the real vLLM engine): one OpenAI file mixing the base and the
  owner's adapter, each line answered by the model it named; bob's lines naming her adapter
  are his job's ``model_not_available`` error records.
"""

from __future__ import annotations

import io
import json
import tarfile
import zipfile
from pathlib import Path

import orjson
import pytest

from tests.api.test_end_to_end import DAG_TEST_USER, dag_test_key  # noqa: F401 - fixture re-used

pytestmark = pytest.mark.airflow

BASE = "tiny-random-llama"
CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"


@pytest.fixture(scope="module")
def lora_dir(tiny_model_dir: Path, tmp_path_factory) -> Path:
    """A rank-8 random LoRA of the tiny Llama (peft's two files)."""
    from llm_batch.core.model_recipes import build_random_lora

    return build_random_lora(tmp_path_factory.mktemp("owner-lora") / "my-lora", tiny_model_dir, rank=8, seed=5)


@pytest.fixture(scope="module")
def lora_files(lora_dir: Path) -> dict[str, bytes]:
    return {CONFIG: (lora_dir / CONFIG).read_bytes(), WEIGHTS: (lora_dir / WEIGHTS).read_bytes()}


@pytest.fixture
def no_dag_runs(batch_api):
    """Creates reach the store; the trigger records nothing in Airflow."""
    from llm_batch.api.dag_trigger import get_trigger, run_id_for

    batch_api.dependency_overrides[get_trigger] = lambda: (lambda job_id, conf, submitted_at: run_id_for(job_id))
    yield
    batch_api.dependency_overrides.pop(get_trigger, None)


def tar_of(files: dict[str, bytes], *, folder: str | None = "my-lora", links: dict[str, str] | None = None) -> bytes:
    """A .tar.gz of `files` (in one top folder unless None) and symlinks (name -> target)."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        prefix = f"{folder}/" if folder else ""
        for name, data in files.items():
            info = tarfile.TarInfo(prefix + name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        for name, target in (links or {}).items():
            info = tarfile.TarInfo(prefix + name)
            info.type, info.linkname = tarfile.SYMTYPE, target
            tar.addfile(info)
    return buffer.getvalue()


def upload(client, headers: dict[str, str], archive: bytes, name: str, base: str = BASE):
    return client.post("/v1/adapters", headers=headers, files={"file": ("lora.tar.gz", archive)},
                       data={"name": name, "base": base})


def _names(client, headers) -> list[str]:
    response = client.get("/v1/adapters", headers=headers)
    assert response.status_code == 200, response.text
    return [a["name"] for a in response.json()["data"]]


def _end(store, *job_ids: str) -> None:
    from llm_batch.core.jobs import JobStatus

    for job_id in job_ids:
        store.end_job(job_id, JobStatus.CANCELLED, "test over")


def _prepared(name: str) -> bool:
    from llm_batch.infra.model_cache import model_status
    from llm_batch.infra.model_registry import load_registry

    return model_status(name, load_registry().models[name]) in ("ready", "stale")


# -- upload, list, get, delete: the owner's alone -------------------------------------------------


def test_an_owner_uploads_an_adapter_no_one_else_sees(client, creds, lora_files, api_store):
    from llm_batch.core.config import get_settings
    from llm_batch.infra import storage

    alice, bob = creds.key("alice"), creds.key("bob")
    created = upload(client, alice, tar_of(lora_files), "alice-bot")
    assert created.status_code == 200, created.text
    body = created.json()
    assert body == {"object": "adapter", "name": "alice-bot", "base": BASE, "rank": 8,
                    "bytes": len(lora_files[WEIGHTS]) + len(lora_files[CONFIG]), "created_at": body["created_at"]}
    stored = api_store.get_adapter("alice", "alice-bot")
    assert stored.uri.startswith(f"{get_settings().work_uri}/adapters/alice/alice-bot-") and stored.uri.endswith("/")
    assert stored.uri not in created.text  # where its files are is never shown
    assert sorted(u.rsplit("/", 1)[1] for u in storage.list_uris(stored.uri)) == [CONFIG, WEIGHTS]

    assert "alice-bot" in _names(client, alice)
    assert "alice-bot" in _names(client, creds.jwt("alice"))  # the same owner as an Airflow user
    assert client.get("/v1/adapters/alice-bot", headers=alice).json() == body
    # bob: as unknown as a made-up name, on every route.
    assert "alice-bot" not in _names(client, bob)
    for method in ("GET", "DELETE"):
        theirs = client.request(method, "/v1/adapters/alice-bot", headers=bob)
        missing = client.request(method, "/v1/adapters/nobody-bot", headers=bob)
        assert theirs.status_code == missing.status_code == 404, theirs.text
        assert theirs.json()["code"] == "not_found" and theirs.json()["param"] == "name"
        assert theirs.text.replace("alice-bot", "nobody-bot") == missing.text
    assert api_store.get_adapter("alice", "alice-bot") == stored  # bob's delete did nothing
    # Admins see their own adapters here, not everyone's.
    assert "alice-bot" not in _names(client, creds.key("admin-key"))


def test_delete_waits_for_the_owner_s_jobs_on_its_base_then_frees_the_name(client, creds, lora_files, api_store,
                                                                             no_dag_runs):
    from llm_batch.infra import storage

    carol = {"Authorization": f"Bearer {api_store.create_api_key('carol', 'adapters')[1]}"}
    assert upload(client, carol, tar_of(lora_files, folder=None), "c-bot").status_code == 200
    uri = api_store.get_adapter("carol", "c-bot").uri
    job = client.post("/v1/jobs", headers=carol, json={"model": BASE, "endpoint": "/v1/chat/completions", "requests": [
        {"custom_id": "a", "body": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}}]})
    assert job.status_code == 200, job.text
    busy = client.delete("/v1/adapters/c-bot", headers=carol)
    assert busy.status_code == 409 and busy.json()["code"] == "adapter_in_use", busy.text
    assert job.json()["id"] in busy.json()["detail"]
    _end(api_store, job.json()["id"])
    deleted = client.delete("/v1/adapters/c-bot", headers=carol)
    assert deleted.status_code == 200 and deleted.json() == {"name": "c-bot", "object": "adapter", "deleted": True}
    assert client.get("/v1/adapters/c-bot", headers=carol).status_code == 404
    assert storage.list_uris(uri) == []  # its files are gone
    assert upload(client, carol, tar_of(lora_files), "c-bot").status_code == 200  # the name is free again


# -- refusals --------------------------------------------------------------------------------------


def _with_rank(files: dict[str, bytes], rank: int) -> dict[str, bytes]:
    return {**files, CONFIG: json.dumps({**json.loads(files[CONFIG]), "r": rank}).encode()}


REFUSALS = {
    # id: (archive from the adapter's files, name, base) -> status, code, a word of the message
    "a pickle instead of safetensors": (lambda f: tar_of({CONFIG: f[CONFIG], "adapter_model.bin": f[WEIGHTS]}),
                                        "r-pickle", BASE, 400, "invalid_adapter", "adapter_model.bin"),
    "a pickle beside": (lambda f: tar_of({**f, "adapter_model.bin": b"\x80\x04."}), "r-pickle2", BASE, 400,
                        "invalid_adapter", "adapter_model.bin"),
    "an extra file": (lambda f: tar_of({**f, "train.py": b"import os"}), "r-extra", BASE, 400, "invalid_adapter",
                      "train.py"),
    "a ../ member": (lambda f: tar_of({"../x": b"x", **f}, folder=None), "r-dotdot", BASE, 400, "invalid_adapter",
                     "'..'"),
    "a symlink member": (lambda f: tar_of({CONFIG: f[CONFIG]}, links={WEIGHTS: "/etc/passwd"}), "r-link", BASE,
                         400, "invalid_adapter", "link"),
    "rank above the deployment's": (lambda f: tar_of(_with_rank(f, 128)), "r-rank", BASE, 400, "invalid_adapter",
                                    "r must be a whole number from 1 to 64"),
    "zeros after the tensors": (lambda f: tar_of({**f, WEIGHTS: f[WEIGHTS] + b"\0" * (1 << 20)}), "r-padded", BASE,
                                400, "invalid_adapter", "fill the file exactly"),
    "not an archive": (lambda f: f[WEIGHTS], "r-raw", BASE, 400, "invalid_adapter", ".tar, .tar.gz or .zip"),
    "an empty file": (lambda f: b"", "r-empty", BASE, 400, "invalid_adapter", "empty"),
    "a base that is no generate model": (lambda f: tar_of(f), "r-embed", "all-minilm-l6-v2", 400, "invalid_base",
                                         "embed model"),
    "an adapter as the base": (lambda f: tar_of(f), "r-on-adapter", "tiny-lora-a", 400, "invalid_base",
                               "'tiny-random-llama'"),
    "an unknown base": (lambda f: tar_of(f), "r-unknown", "no-such-model", 400, "unknown_model", "no-such-model"),
    "a registry model's name": (lambda f: tar_of(f), BASE, BASE, 409, "name_taken", "model of the model registry"),
    "a registry adapter's name": (lambda f: tar_of(f), "tiny-lora-a", BASE, 409, "name_taken",
                                  "adapter of the model registry"),
    "a name with a slash": (lambda f: tar_of(f), "../evil", BASE, 400, "invalid_name", "not admitted"),
    "a name with a space": (lambda f: tar_of(f), "my bot", BASE, 400, "invalid_name", "not admitted"),
    "a name starting with a dash": (lambda f: tar_of(f), "-bot", BASE, 400, "invalid_name", "not admitted"),
    "a name too long": (lambda f: tar_of(f), "b" * 65, BASE, 400, "invalid_name", "1 to 64"),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_a_refused_upload_is_a_precise_4xx_and_keeps_nothing(client, creds, lora_files, api_store, case):
    make, name, base, status, code, words = REFUSALS[case]
    before = api_store.list_adapters("alice")
    response = upload(client, creds.key("alice"), make(lora_files), name, base)
    assert response.status_code == status, response.text
    assert response.json()["code"] == code and words in response.json()["detail"], response.text
    assert response.json()["param"] in ("file", "name", "base")
    assert api_store.list_adapters("alice") == before


def test_a_name_twice_is_409_and_a_viewer_may_not_upload(client, creds, lora_files):
    archive = tar_of(lora_files)
    assert upload(client, creds.key("alice"), archive, "alice-twice").status_code == 200
    again = upload(client, creds.key("alice"), archive, "alice-twice")
    assert again.status_code == 409 and again.json()["code"] == "adapter_exists", again.text
    assert upload(client, creds.key("bob"), archive, "alice-twice").status_code == 200  # bob's own name space
    viewer = upload(client, creds.jwt("vic"), archive, "vic-bot")
    assert viewer.status_code == 403 and viewer.json()["code"] == "forbidden"


def test_too_big_is_413_for_the_archive_and_for_what_it_unpacks_to(client, creds, lora_files, batch_api, monkeypatch):
    settings = batch_api.state.llm_batch.settings
    archive = tar_of(lora_files)
    monkeypatch.setattr(settings, "max_adapter_bytes", len(archive) - 1)
    response = upload(client, creds.key("alice"), archive, "r-big")
    assert response.status_code == 413 and response.json()["code"] == "file_too_large", response.text
    assert str(len(archive) - 1) in response.json()["detail"]
    # Zeros compress well: a small archive of a big file.
    bomb = tar_of({CONFIG: lora_files[CONFIG], WEIGHTS: b"\0" * (4 << 20)})
    monkeypatch.setattr(settings, "max_adapter_bytes", len(bomb) + 10)
    response = upload(client, creds.key("alice"), bomb, "r-bomb")
    assert response.status_code == 413 and response.json()["code"] == "file_too_large", response.text
    assert "r-big" not in _names(client, creds.key("alice")) and "r-bomb" not in _names(client, creds.key("alice"))


def test_an_adapter_counts_in_the_owner_s_stored_bytes(client, creds, lora_files, api_store, batch_api, monkeypatch):
    """Its two files count in max_file_bytes as a file upload does: over the limit is 429
    naming it, and nothing is kept; deleting it frees them."""
    settings = batch_api.state.llm_batch.settings
    dora = {"Authorization": f"Bearer {api_store.create_api_key('dora', 'quota')[1]}"}
    size = len(lora_files[WEIGHTS]) + len(lora_files[CONFIG])
    held = api_store.owner_usage("dora")["file_bytes"]
    monkeypatch.setattr(settings, "owner_limits", {"dora": {"max_file_bytes": held + size - 1}})
    over = upload(client, dora, tar_of(lora_files), "d-bot")
    assert over.status_code == 429 and over.json()["code"] == "limit_exceeded", over.text
    assert over.json()["param"] == "max_file_bytes" and f"{size} more asked" in over.json()["detail"]
    assert api_store.list_adapters("dora") == [] and api_store.owner_usage("dora")["file_bytes"] == held

    monkeypatch.setitem(settings.owner_limits["dora"], "max_file_bytes", held + size)
    assert upload(client, dora, tar_of(lora_files), "d-bot").status_code == 200
    assert api_store.owner_usage("dora")["file_bytes"] == held + size
    # Full now: another adapter, or a file, is refused.
    assert upload(client, dora, tar_of(lora_files), "d-bot2").status_code == 429
    file = client.post("/v1/files", headers=dora, files={"file": ("a.jsonl", b'{"custom_id": "a", "body": {}}\n')},
                       data={"purpose": "batch"})
    assert file.status_code == 429 and file.json()["error"]["param"] == "max_file_bytes", file.text
    assert client.delete("/v1/adapters/d-bot", headers=dora).status_code == 200
    assert api_store.owner_usage("dora")["file_bytes"] == held


def test_a_zip_is_taken_too(client, creds, lora_files):
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as zipped:
        for name, data in lora_files.items():
            zipped.writestr(f"my-lora/{name}", data)
    response = upload(client, creds.key("alice"), buffer.getvalue(), "alice-zipped")
    assert response.status_code == 200 and response.json()["rank"] == 8, response.text


def test_an_adapter_of_another_base_s_shape_is_refused(client, creds, lora_files):
    base = "smollm2-135m-instruct"
    if not _prepared(base):
        pytest.skip(f"{base} is not prepared in the test home (a download of the model's package): the shape check "
                    "against another base has its unit tests (tests/unit/test_adapters.py)")
    response = upload(client, creds.key("alice"), tar_of(lora_files), "r-shape", base)
    assert response.status_code == 400 and response.json()["code"] == "invalid_adapter", response.text
    assert "not the base's" in response.json()["detail"] or "layer" in response.json()["detail"]


def test_a_base_not_prepared_on_the_api_server_is_400_saying_so(client, creds, lora_files):
    base = "smollm2-135m-instruct"
    if _prepared(base):
        pytest.skip(f"{base} is prepared in the test home: no base of the registry is left unprepared to try")
    response = upload(client, creds.key("alice"), tar_of(lora_files), "r-unprepared", base)
    assert response.status_code == 400 and response.json()["code"] == "base_not_prepared", response.text
    assert f"llm-batch models prepare {base}" in response.json()["detail"]


def test_a_malformed_name_in_the_path_is_refused(client, creds):
    for name in ("x" * 65, "a b", "-x"):
        assert client.get(f"/v1/adapters/{name}", headers=creds.key("alice")).status_code == 422, name
        assert client.delete(f"/v1/adapters/{name}", headers=creds.key("alice")).status_code == 422, name


# -- jobs naming the owner's adapter ---------------------------------------------------------------


def test_a_job_of_her_own_adapter_is_accepted_on_every_route_and_unknown_for_bob(client, creds, lora_files, api_store,
                                                                                  alice_dir, no_dag_runs):
    alice, bob = creds.key("alice"), creds.key("bob")
    assert upload(client, alice, tar_of(lora_files), "alice-jobs").status_code == 200
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    created = []
    native = client.post("/v1/jobs", headers=alice, json={"model": "alice-jobs", "endpoint": "/v1/chat/completions",
                                                          "requests": [{"custom_id": "a", "body": chat}]})
    assert native.status_code == 200 and native.json()["model"] == "alice-jobs", native.text
    created.append(native.json()["id"])
    line = orjson.dumps({"custom_id": "a", "method": "POST", "url": "/v1/chat/completions",
                         "body": {"model": "alice-jobs", **chat}}) + b"\n"
    file_id = client.post("/v1/files", headers=alice, files={"file": ("in.jsonl", line)},
                          data={"purpose": "batch"}).json()["id"]
    batch = client.post("/v1/batches", headers=alice, json={"input_file_id": file_id, "endpoint": "/v1/chat/completions",
                                                            "completion_window": "24h"})
    assert batch.status_code == 200 and batch.json()["model"] == "alice-jobs", batch.text
    created.append(batch.json()["id"])
    mistral = client.post("/v1/batch/jobs", headers=alice, json={"model": "alice-jobs", "endpoint": "/v1/chat/completions",
                                                                 "requests": [{"custom_id": "a", "body": chat}]})
    assert mistral.status_code == 200 and mistral.json()["model"] == "alice-jobs", mistral.text
    created.append(mistral.json()["id"])
    scale = client.post("/v2/batch-completions", headers=alice, json={
        "output_data_path": f"{alice_dir}/own-adapter.json", "model_config": {"model": "alice-jobs"},
        "content": [{"prompt": "hi", "max_tokens": 2}]})
    assert scale.status_code == 200, scale.text
    created.append(scale.json()["job_id"])
    assert [api_store.get_job(j).model for j in created] == ["alice-jobs"] * 4
    _end(api_store, *created)

    refused = client.post("/v1/jobs", headers=bob, json={"model": "alice-jobs", "endpoint": "/v1/chat/completions",
                                                         "requests": [{"custom_id": "a", "body": chat}]})
    assert refused.status_code == 400 and refused.json()["code"] == "unknown_model", refused.text
    embed = client.post("/v1/jobs", headers=alice, json={"model": "alice-jobs", "endpoint": "/v1/embeddings",
                                                         "requests": [{"custom_id": "a", "body": {"input": "hi"}}]})
    assert embed.status_code == 400 and embed.json()["code"] == "model_endpoint_mismatch", embed.text


# -- a real run ------------------------------------------------------------------------------------


def _line(custom_id: str, model: str) -> bytes:
    return orjson.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": {
        "model": model, "messages": [{"role": "user", "content": "The quick brown fox"}], "max_tokens": 6,
        "temperature": 0}}) + b"\n"


@pytest.mark.engine
def test_a_real_run_mixes_the_base_and_the_owner_s_adapter(live_server, dag_test_key, dag_bag, tiny_model_dir,  # noqa: F811
                                                           engine_env, api_store, lora_files, creds):
    import httpx
    from openai import OpenAI

    from llm_batch.core.config import get_settings
    from llm_batch.core.layout import JobLayout
    from llm_batch.infra import storage
    from llm_batch.pipeline import steps

    mine = "dt-lora"
    uploaded = httpx.post(f"{live_server}/batch/v1/adapters", headers={"Authorization": f"Bearer {dag_test_key}"},
                          files={"file": ("lora.tar.gz", tar_of(lora_files))}, data={"name": mine, "base": BASE},
                          timeout=120)
    assert uploaded.status_code == 200, uploaded.text

    client = OpenAI(api_key=dag_test_key, base_url=f"{live_server}/batch/v1", max_retries=0)
    models = [BASE, mine] * 2
    content = b"".join(_line(f"ok-{i}", model) for i, model in enumerate(models))
    file = client.files.create(file=("mine.jsonl", content), purpose="batch")
    batch = client.batches.create(input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h")
    dag_bag.get_dag("batch_inference").test(run_conf={"job_id": batch.id})

    done = client.batches.retrieve(batch.id)
    assert done.status == "completed", (done.status, done.errors)
    assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (4, 4, 0)
    results = [orjson.loads(line) for line in client.files.content(done.output_file_id).content.splitlines()]
    assert [r["response"]["body"]["model"] for r in results] == models
    texts: dict[str, set[str]] = {}
    for model, result in zip(models, results, strict=True):
        texts.setdefault(model, set()).add(result["response"]["body"]["choices"][0]["message"]["content"])
    assert all(len(t) == 1 for t in texts.values()), texts  # one answer per model to the one prompt
    assert texts[BASE] != texts[mine], "the owner's adapter answered as the base"
    usage = api_store.get_job(batch.id).model_usage
    assert {m: u["succeeded"] for m, u in usage.items()} == {BASE: 2, mine: 2}

    # bob names her adapter in his lines: those lines are his job's error records.
    bob = OpenAI(api_key=creds.keys["bob"], base_url=f"{live_server}/batch/v1", max_retries=0)
    theirs = b"".join(_line(f"b{i}", model) for i, model in enumerate([BASE, mine, BASE, mine]))
    bob_batch = bob.batches.create(input_file_id=bob.files.create(file=("b.jsonl", theirs), purpose="batch").id,
                                   endpoint="/v1/chat/completions", completion_window="24h")
    try:
        counts = steps.validate(api_store, get_settings(), bob_batch.id)  # what his run's first step does
        assert counts == {"total": 4, "valid": 2, "invalid": 2}
        layout = JobLayout(get_settings().work_uri, bob_batch.id)
        errors = [orjson.loads(line) for line in storage.read_bytes(layout.validation_errors).splitlines()]
        assert [(e["custom_id"], e["line"], e["code"]) for e in errors] == [
            ("b1", 2, "model_not_available"), ("b3", 4, "model_not_available")]
        assert mine in errors[0]["message"]
    finally:
        _end(api_store, bob_batch.id)
