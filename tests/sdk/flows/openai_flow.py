"""The OpenAI Batch API flow as openai-python's docs show it (files + batches), one step per
call of the test; see _flow.py for the protocol."""

from __future__ import annotations

from _flow import custom_ids, refusal, run
from openai import OpenAI

ENDPOINT = "/v1/chat/completions"


def client_of(base: str, key: str) -> OpenAI:
    return OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0)


def create(base, key, input_path, bad_model_path, metadata):
    client = client_of(base, key)
    with open(input_path, "rb") as f:
        uploaded = client.files.create(file=f, purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint=ENDPOINT, completion_window="24h", metadata=metadata)
    other = client.batches.create(input_file_id=uploaded.id, endpoint=ENDPOINT, completion_window="24h")
    cancelled = client.batches.cancel(other.id)
    with open(bad_model_path, "rb") as f:
        bad_file = client.files.create(file=f, purpose="batch")
    return {
        "file": {"id": uploaded.id, "bytes": uploaded.bytes, "purpose": uploaded.purpose, "filename": uploaded.filename},
        "batch": {"id": batch.id, "status": batch.status, "metadata": batch.metadata, "input_file_id": batch.input_file_id,
                  "endpoint": batch.endpoint},
        "cancelled": {"id": cancelled.id, "status": cancelled.status},
        "refused": {
            "unknown_model": refusal(lambda: client.batches.create(input_file_id=bad_file.id, endpoint=ENDPOINT, completion_window="24h")),
            "missing_batch": refusal(lambda: client.batches.retrieve("batch_does_not_exist")),
            "wrong_key": refusal(lambda: client_of(base, "lbk_wrong").files.list()),
            "file_in_use": refusal(lambda: client.files.delete(uploaded.id)),
        },
    }


def create_adapter(base, key, input_path, unknown_path, other_base_path):
    """A batch whose first line names a LoRA adapter (the job's model), its other lines another
    adapter and the base; one whose first line names an adapter nobody has; and one with a
    line naming another base's adapter (that line's error at validation, not the create's)."""
    client = client_of(base, key)
    with open(input_path, "rb") as f:
        uploaded = client.files.create(file=f, purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint=ENDPOINT, completion_window="24h")
    got = client.batches.retrieve(batch.id)
    with open(unknown_path, "rb") as f:
        unknown = client.files.create(file=f, purpose="batch")
    with open(other_base_path, "rb") as f:
        other_base = client.files.create(file=f, purpose="batch")
    mixed = client.batches.create(input_file_id=other_base.id, endpoint=ENDPOINT, completion_window="24h")
    return {
        "file": {"id": uploaded.id},
        "other_base": {"id": mixed.id, "status": mixed.status},
        "batch": {"id": batch.id, "status": batch.status, "input_file_id": batch.input_file_id, "endpoint": batch.endpoint},
        "retrieved": {"id": got.id, "status": got.status},
        "refused": {"unknown_adapter": refusal(lambda: client.batches.create(input_file_id=unknown.id, endpoint=ENDPOINT,
                                                                            completion_window="24h"))},
    }


def get(base, key, batch_id):
    batch = client_of(base, key).batches.retrieve(batch_id)
    counts = batch.request_counts
    return {"status": batch.status, "counts": counts and [counts.total, counts.completed, counts.failed]}


def download(base, key, batch_id, input_file_id):
    client = client_of(base, key)
    batch = client.batches.retrieve(batch_id)
    observed = {
        **get(base, key, batch_id),
        "outputs": custom_ids(client.files.content(batch.output_file_id).text),
        "errors": custom_ids(client.files.content(batch.error_file_id).text),
        # batches.list came in openai 1.22.0; iterating pages through `after`.
        "listed": [b.id for b in client.batches.list(limit=1)] if hasattr(client.batches, "list") else None,
        "files": [f.id for f in client.files.list(purpose="batch")],
        "deleted": client.files.delete(input_file_id).deleted,
    }
    observed["refused"] = {"deleted_file": refusal(lambda: client.files.retrieve(input_file_id))}
    return observed


def foreign(base, key, batch_id, file_id):
    """Another user's batch and file, as this key sees them."""
    client = client_of(base, key)
    return {"refused": {
        "retrieve": refusal(lambda: client.batches.retrieve(batch_id)),
        "cancel": refusal(lambda: client.batches.cancel(batch_id)),
        "content": refusal(lambda: client.files.content(file_id)),
    }}


if __name__ == "__main__":
    run("openai", {"create": create, "create_adapter": create_adapter, "get": get, "download": download, "foreign": foreign})
