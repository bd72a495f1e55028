"""One create-wait-download flow with an official client, as its docs show, run in that
client's own venv against the embedded stack: `python newest_client.py openai|mistralai|scale`.
Env: BASE (the stack's URL), KEY (an API key), MODEL. Prints one JSON line of what it saw."""

import json
import os
import sys
import time

BASE, KEY, MODEL, CLIENT = os.environ["BASE"], os.environ["KEY"], os.environ["MODEL"], sys.argv[1]
N, DONE_WITHIN = 6, 600
BODIES = [{"model": MODEL, "messages": [{"role": "user", "content": f"Name a colour {i}."}], "max_tokens": 8} for i in range(N)]
LINES = "".join(json.dumps({"custom_id": f"q{i}", "method": "POST", "url": "/v1/chat/completions", "body": b}) + "\n"
                for i, b in enumerate(BODIES))


def wait(get, ended):
    deadline = time.monotonic() + DONE_WITHIN
    while not ended(job := get()):
        if time.monotonic() > deadline:
            raise TimeoutError(f"not done after {DONE_WITHIN} s")
        time.sleep(2)
    return job


if CLIENT == "openai":
    from openai import OpenAI

    client = OpenAI(base_url=f"{BASE}/batch/v1", api_key=KEY)
    uploaded = client.files.create(file=("requests.jsonl", LINES.encode()), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
    batch = wait(lambda: client.batches.retrieve(batch.id), lambda b: b.status in ("completed", "failed", "expired", "cancelled"))
    ids = [json.loads(line)["custom_id"] for line in client.files.content(batch.output_file_id).text.splitlines()]
    seen = {"status": batch.status, "counts": batch.request_counts.model_dump(), "model": batch.model, "ids": ids,
            "usage": batch.usage.model_dump() if batch.usage else None}
elif CLIENT == "mistralai":
    from mistralai.client import Mistral

    client = Mistral(server_url=f"{BASE}/batch", api_key=KEY)
    job = client.batch.jobs.create(requests=[{"custom_id": f"q{i}", "body": b} for i, b in enumerate(BODIES)],
                                   endpoint="/v1/chat/completions", model=MODEL)
    job = wait(lambda: client.batch.jobs.get(job_id=job.id), lambda j: j.status in ("SUCCESS", "FAILED", "TIMEOUT_EXCEEDED", "CANCELLED"))
    ids = [json.loads(line)["custom_id"] for line in client.files.download(file_id=job.output_file).read().decode().splitlines()]
    seen = {"status": job.status, "counts": [job.total_requests, job.completed_requests, job.succeeded_requests, job.failed_requests],
            "ids": ids}
else:
    from llmengine import Completion, api_engine
    from llmengine.data_types import (
        CreateBatchCompletionsModelConfig,
        CreateBatchCompletionsRequestContent,
        FilteredChatCompletionV2Request,
    )

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "sdk", "flows"))
    from scale_flow import parse_output  # each output item parsed by the client's own type

    config = CreateBatchCompletionsModelConfig(model=MODEL)
    created = Completion.batch_create(
        output_data_path="e2e/newest-scale-client.json",  # relative: the caller's own folder
        model_config=config,
        content=[FilteredChatCompletionV2Request(messages=b["messages"], max_tokens=b["max_tokens"]) for b in BODIES],
        use_v2=True,
    )
    # The v1 route (the client's default), asking for each token's log probability.
    v1 = Completion.batch_create(
        output_data_path="e2e/newest-scale-client-v1.json", model_config=config, use_v2=False,
        content=CreateBatchCompletionsRequestContent(prompts=[b["messages"][0]["content"] for b in BODIES],
                                                     max_new_tokens=8, temperature=0.0, return_token_log_probs=True))

    def ended(job_id):
        return wait(lambda: api_engine.APIEngine._get(f"v2/batch-completions/{job_id}", timeout=30)["job"],
                    lambda j: j["status"] in ("completed", "failed", "cancelled"))

    def output(job):
        with open(job["output_data_path"]) as f:
            return json.load(f)

    job, v1_job = ended(created.job_id), ended(v1.job_id)
    seen = {"status": job["status"], "metadata": job["metadata"], "output": job["output_data_path"],
            "chat": parse_output(output(job), "chat"),
            "v1": {"status": v1_job["status"], "succeeded": v1_job["metadata"]["succeeded_requests"],
                   **parse_output(output(v1_job), "v1")}}
print(json.dumps(seen))
