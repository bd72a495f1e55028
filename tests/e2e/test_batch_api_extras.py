"""The batch API's extras on the real embedded stack: a retried create with one
Idempotency-Key makes one batch (the openai SDK, as a user sends it), and the job's end
arrives once as a signed webhook from the api-server's own deliverer, verified by the
openai SDK's ``webhooks.unwrap``."""

from __future__ import annotations

import json
import threading
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from tests.e2e.conftest import MODEL, wait_until

pytestmark = pytest.mark.e2e
TIMEOUT = 420


class _Receiver:
    """A local HTTP receiver keeping every request's headers and body."""

    def __init__(self) -> None:
        received = self.received = []

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers.get("content-length", 0)))
                received.append(({k.lower(): v for k, v in self.headers.items()}, body))
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()


def test_one_key_one_batch_and_its_end_arrives_once_signed(e2e_stack, batch_client, tmp_path: Path):
    from openai import OpenAI

    receiver = _Receiver()
    try:
        hook = batch_client.create_webhook(receiver.url, events=["batch.completed", "batch.failed"])
        secret = hook["secret"]
        assert secret.startswith("whsec_")
        client = OpenAI(base_url=f"{e2e_stack.base_url}/batch/v1", api_key=e2e_stack.ensure_api_key())
        lines = [{"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions",
                  "body": {"model": MODEL, "messages": [{"role": "user", "content": f"q{i}"}], "max_tokens": 4}}
                 for i in range(3)]
        path = tmp_path / "in.jsonl"
        path.write_text("".join(json.dumps(line) + "\n" for line in lines))
        uploaded = client.files.create(file=path.open("rb"), purpose="batch")
        key = {"Idempotency-Key": f"e2e-{uuid.uuid4().hex}"}
        first = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                      completion_window="24h", extra_headers=key)
        again = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                      completion_window="24h", extra_headers=key)
        assert again.id == first.id  # a retried create is the same batch
        done = wait_until("the batch to end", lambda: (b := client.batches.retrieve(first.id)).status
                          in ("completed", "failed", "cancelled", "expired") and b, TIMEOUT)
        assert done.status == "completed" and done.request_counts.completed == 3

        def events_of_job():
            return [(h, b) for h, b in receiver.received if json.loads(b)["data"]["id"] == first.id]

        wait_until("the signed event", events_of_job, 120)
        [(headers, body)] = events_of_job()
        event = client.webhooks.unwrap(body.decode(), headers, secret=secret)
        assert event.type == "batch.completed" and event.data.id == first.id
        attempts = [a for a in batch_client.webhook_attempts(hook["id"]) if a["job_id"] == first.id]
        assert [(a["status_code"], a["delivery_status"]) for a in attempts] == [(200, "delivered")]
        assert attempts[0]["webhook_id"] == headers["webhook-id"]
    finally:
        receiver.close()
