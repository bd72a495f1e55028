"""The Mistral batch flow as mistralai's docs show it (files + batch jobs), one step per call
of the test; see _flow.py for the protocol. Where a release lacks a call or argument (inline
`requests`, a list `status` filter, `get(inline=)`), the step says so (None) instead."""

from __future__ import annotations

import inspect

from _flow import custom_ids, refusal, run

try:  # mistralai >= 2.0
    from mistralai.client import Mistral
except ImportError:  # mistralai 1.x (its mistralai.client is the legacy MistralClient stub)
    from mistralai import Mistral

ENDPOINT = "/v1/chat/completions"


def client_of(base: str, key: str) -> Mistral:
    return Mistral(server_url=base, api_key=key)


def takes(method, name: str) -> bool:
    return name in inspect.signature(method).parameters


def create(base, key, input_path, model, metadata, inline_requests):
    client = client_of(base, key)
    with open(input_path, "rb") as f:
        uploaded = client.files.upload(file={"file_name": "requests.jsonl", "content": f}, purpose="batch")
    job = client.batch.jobs.create(input_files=[uploaded.id], endpoint=ENDPOINT, model=model, metadata=metadata, timeout_hours=3)
    inline = None
    if takes(client.batch.jobs.create, "requests"):
        inline = client.batch.jobs.create(requests=inline_requests, endpoint=ENDPOINT, model=model)
    other = client.batch.jobs.create(input_files=[uploaded.id], endpoint=ENDPOINT, model=model)
    cancelled = client.batch.jobs.cancel(job_id=other.id)
    return {
        "import": Mistral.__module__.rsplit(".", 1)[0],
        # The size is `.bytes` in 1.x, `.size_bytes` (alias of the wire's "bytes") from 2.0.
        "file": {"id": uploaded.id, "bytes": getattr(uploaded, "size_bytes", None) or uploaded.bytes, "purpose": str(uploaded.purpose),
                 "sample_type": str(uploaded.sample_type)},
        "job": {"id": job.id, "status": str(job.status), "input_files": job.input_files, "metadata": job.metadata,
                "model": job.model},
        "inline": inline and {"id": inline.id, "status": str(inline.status)},
        "cancelled": {"id": cancelled.id, "status": str(cancelled.status)},
        "refused": {
            "unknown_model": refusal(lambda: client.batch.jobs.create(input_files=[uploaded.id], endpoint=ENDPOINT, model="no-such-model")),
            "missing_job": refusal(lambda: client.batch.jobs.get(job_id="00000000-0000-0000-0000-000000000000")),
            "wrong_key": refusal(lambda: client_of(base, "lbk_wrong").files.list()),
        },
    }


def create_adapter(base, key, input_path, model, metadata, unknown_model):
    """A job whose model is a LoRA adapter (its lines name none: they run on it), as read
    back by jobs.get; and one naming an adapter nobody has."""
    client = client_of(base, key)
    with open(input_path, "rb") as f:
        uploaded = client.files.upload(file={"file_name": "adapter.jsonl", "content": f}, purpose="batch")
    job = client.batch.jobs.create(input_files=[uploaded.id], endpoint=ENDPOINT, model=model, metadata=metadata)
    got = client.batch.jobs.get(job_id=job.id)
    return {
        "file": {"id": uploaded.id},
        "job": {"id": job.id, "status": str(job.status), "input_files": job.input_files, "model": job.model},
        "got": {"status": str(got.status), "model": got.model},
        "refused": {"unknown_adapter": refusal(lambda: client.batch.jobs.create(input_files=[uploaded.id], endpoint=ENDPOINT,
                                                                               model=unknown_model))},
    }


def get(base, key, job_id):
    job = client_of(base, key).batch.jobs.get(job_id=job_id)
    return {"status": str(job.status), "counts": [job.total_requests, job.succeeded_requests, job.failed_requests]}


def download(base, key, job_id, inline_id, model, metadata):
    client = client_of(base, key)
    jobs = client.batch.jobs
    job = jobs.get(job_id=job_id)
    # mistralai 1.2 filters one status (`status="SUCCESS"`), later releases a list of them.
    annotation = str(inspect.signature(jobs.list).parameters["status"].annotation)
    many = "List" in annotation or "Iterable" in annotation
    succeeded = jobs.list(status=["SUCCESS"] if many else "SUCCESS", page_size=1000)
    observed = {
        **get(base, key, job_id),
        "outputs": custom_ids(client.files.download(file_id=job.output_file).read()),
        "errors": custom_ids(client.files.download(file_id=job.error_file).read()),
        "listed": {
            "success": [j.id for j in succeeded.data],
            "metadata": [j.id for j in jobs.list(metadata=metadata, created_by_me=True).data],  # sent as ?team=...
            "metadata_none": jobs.list(metadata={"team": "nobody"}).total,
            "model": [j.id for j in jobs.list(model=model, page_size=1000).data],
        },
        "files_total": client.files.list(page_size=10).total,
    }
    if inline_id:
        inline = jobs.get(job_id=inline_id)
        observed["inline"] = {"status": str(inline.status), "outputs": [o.get("custom_id") for o in inline.outputs or []]}
        if takes(jobs.get, "inline"):
            observed["inline"]["get_inline"] = [o.get("custom_id") for o in jobs.get(job_id=inline_id, inline=True).outputs or []]
    return observed


def foreign(base, key, job_id, file_id):
    """Another user's job and file, as this key sees them."""
    client = client_of(base, key)
    return {"refused": {
        "get": refusal(lambda: client.batch.jobs.get(job_id=job_id)),
        "cancel": refusal(lambda: client.batch.jobs.cancel(job_id=job_id)),
        "download": refusal(lambda: client.files.download(file_id=file_id).read()),
    }}


if __name__ == "__main__":
    run("mistralai", {"create": create, "create_adapter": create_adapter, "get": get, "download": download, "foreign": foreign})
