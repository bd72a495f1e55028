"""The benchmarks' S3 server: SeaweedFS started by the project's own code
(``llm_batch.devstack.s3_server``, the server the Celery shape and the tests' fixture start),
one bucket, and the environment that points llm-batch's storage at it."""

from __future__ import annotations

from contextlib import ExitStack
from pathlib import Path
from typing import Any

BUCKET = "llm-batch-bench"


def start_s3(root: Path, cleanup: ExitStack) -> tuple[Any, dict[str, str]]:
    """A server with its data under ``root`` (killed when ``cleanup`` closes) and ``BUCKET``
    made; returns it and the environment for llm-batch's S3 storage, the URIs aside (each
    caller says which of work, files and the result cache go to the bucket)."""
    from llm_batch.devstack.s3_server import WeedServer

    server = WeedServer.start(root, "llmbatchbench", "llm-batch-bench-secret")
    cleanup.callback(server.kill)
    server.ensure_bucket(BUCKET)
    return server, {"LLM_BATCH_S3_ENDPOINT_URL": server.endpoint_url, "AWS_ACCESS_KEY_ID": server.access_key,
                    "AWS_SECRET_ACCESS_KEY": server.secret_key, "AWS_DEFAULT_REGION": "us-east-1",
                    "AWS_EC2_METADATA_DISABLED": "true", "LLM_BATCH_ALLOWED_BUCKETS": BUCKET}
