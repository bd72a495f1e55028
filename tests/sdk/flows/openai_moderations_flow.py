"""An OpenAI /v1/moderations batch as openai-python's docs show one (a JSONL file of
`{"custom_id", "method", "url", "body"}` lines, `files.create`, `batches.create`), then
`batches.retrieve` and `files.content` of the output and error files; each output body is
parsed with the client's own `ModerationCreateResponse` (`model_validate`: every field
present and typed), so a shape the client cannot read fails the step. See _flow.py."""

from __future__ import annotations

import json

from _flow import refusal, run
from openai import OpenAI
from openai.types import ModerationCreateResponse

ENDPOINT = "/v1/moderations"


def create(base, key, input_path, other_input_path):
    client = OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0)
    with open(input_path, "rb") as f:
        uploaded = client.files.create(file=f, purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint=ENDPOINT, completion_window="24h")
    with open(other_input_path, "rb") as f:
        other = client.files.create(file=f, purpose="batch")
    return {"id": batch.id, "status": batch.status, "endpoint": batch.endpoint,
            # the same lines naming a model mapped to Mistral's categories: refused at create
            "refused": refusal(lambda: client.batches.create(input_file_id=other.id, endpoint=ENDPOINT, completion_window="24h"))}


def results(base, key, batch_id):
    client = OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0)
    batch = client.batches.retrieve(batch_id)
    lines = [json.loads(line) for line in client.files.content(batch.output_file_id).text.splitlines() if line.strip()]
    errors = []
    if batch.error_file_id:
        errors = [json.loads(line) for line in client.files.content(batch.error_file_id).text.splitlines() if line.strip()]
    counts = batch.request_counts
    return {
        "status": batch.status,
        "counts": [counts.total, counts.completed, counts.failed],
        "outputs": [{"custom_id": line["custom_id"], "status_code": line["response"]["status_code"],
                     "parsed": ModerationCreateResponse.model_validate(line["response"]["body"]).model_dump(mode="json", by_alias=True)}
                    for line in lines],
        "errors": [{"custom_id": e.get("custom_id"), "error": e.get("error")} for e in errors],
    }


if __name__ == "__main__":
    run("openai", {"create": create, "results": results})
