"""Mistral's other batch endpoints (fim, classifications, moderations, transcriptions, ocr) as
mistralai's docs show a batch: `files.upload` of the audio and images lines name by id,
inline `requests` to `batch.jobs.create`, then `batch.jobs.get` and
`files.download` of the output and error files; each output line's body is parsed with the
client's own response model of the endpoint (`FIMCompletionResponse`, ...), so a shape the
client cannot read fails the step. See _flow.py for the protocol (mistralai >= 2.0)."""

from __future__ import annotations

import base64
import json

from _flow import refusal, run
from mistralai.client import Mistral, models

# The client's response model of each endpoint (what `client.fim.complete`,
# `client.classifiers.classify` ... return).
RESPONSE_MODEL = {
    "/v1/fim/completions": models.FIMCompletionResponse,
    "/v1/classifications": models.ClassificationResponse,
    "/v1/chat/classifications": models.ClassificationResponse,
    "/v1/moderations": models.ModerationResponse,
    "/v1/chat/moderations": models.ModerationResponse,
    "/v1/audio/transcriptions": models.TranscriptionResponse,
    "/v1/ocr": models.OCRResponse,
}


def upload(base, key, file_name, content, purpose):
    """Upload a file (``content`` base64 here, bytes to the client) as lines name it by id."""
    client = Mistral(server_url=base, api_key=key)
    uploaded = client.files.upload(file={"file_name": file_name, "content": base64.b64decode(content)}, purpose=purpose)
    return {"id": uploaded.id, "bytes": uploaded.size_bytes, "purpose": str(uploaded.purpose)}


def create(base, key, endpoint, model, requests, other_model=None):
    client = Mistral(server_url=base, api_key=key)
    job = client.batch.jobs.create(requests=requests, endpoint=endpoint, model=model)
    observed = {"id": job.id, "status": str(job.status), "endpoint": job.endpoint, "total": job.total_requests}
    if other_model:  # a model that does not serve the endpoint: refused at create
        observed["refused"] = refusal(lambda: client.batch.jobs.create(requests=requests, endpoint=endpoint, model=other_model))
    return observed


def results(base, key, job_id):
    client = Mistral(server_url=base, api_key=key)
    job = client.batch.jobs.get(job_id=job_id)
    parse = RESPONSE_MODEL[job.endpoint].model_validate
    lines = [json.loads(line) for line in client.files.download(file_id=job.output_file).read().decode().splitlines() if line.strip()]
    errors = []
    if job.error_file:
        errors = [json.loads(line) for line in client.files.download(file_id=job.error_file).read().decode().splitlines() if line.strip()]
    return {
        "status": str(job.status),
        "counts": [job.total_requests, job.completed_requests, job.succeeded_requests, job.failed_requests],
        "inline": [o.get("custom_id") for o in job.outputs or []],
        "outputs": [{"custom_id": line["custom_id"], "status_code": line["response"]["status_code"],
                     "parsed": parse(line["response"]["body"]).model_dump(mode="json")} for line in lines],
        "errors": [{"custom_id": e.get("custom_id"), "error": e.get("error")} for e in errors],
    }


if __name__ == "__main__":
    run("mistralai", {"upload": upload, "create": create, "results": results})
