"""S3Storage's retry policy and stream resumption, with botocore's Stubber (no server).

The real server paths are in tests/integration/test_storage_s3.py; a server cannot be made
to throttle or drop a connection on cue, so these cases are stubbed.
"""

from __future__ import annotations

import io

import boto3
import pytest
from botocore.response import StreamingBody
from botocore.stub import Stubber
from urllib3.exceptions import ProtocolError

from llm_batch.infra import storage
from llm_batch.infra.storage import AccessDenied, S3Storage, StorageError

URI = "s3://bucket/key.jsonl"


@pytest.fixture
def s3(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr("tenacity.nap.time.sleep", lambda _seconds: None)  # no real backoff
    client = boto3.client("s3", region_name="us-east-1", aws_access_key_id="k",
                          aws_secret_access_key="s")
    with Stubber(client) as stubber:
        yield S3Storage(client), stubber
        stubber.assert_no_pending_responses()


def test_throttling_then_success_is_retried(s3) -> None:
    backend, stubber = s3
    stubber.add_client_error("head_object", "SlowDown", http_status_code=503)
    stubber.add_client_error("head_object", "InternalError", http_status_code=500)
    stubber.add_response("head_object", {"ContentLength": 42}, {"Bucket": "bucket", "Key": "key.jsonl"})
    assert backend.size(URI) == 42


def test_retries_are_bounded(s3) -> None:
    backend, stubber = s3
    for _ in range(storage.RETRY_ATTEMPTS):
        stubber.add_client_error("head_object", "ServiceUnavailable", http_status_code=503)
    with pytest.raises(StorageError, match=f"{URI}: ServiceUnavailable"):
        backend.size(URI)


def test_denied_is_not_retried(s3) -> None:
    backend, stubber = s3
    stubber.add_client_error("get_object", "InvalidAccessKeyId", http_status_code=403)
    with pytest.raises(AccessDenied, match="InvalidAccessKeyId"):
        with backend.open_read(URI):
            pass


class _DroppingStream(io.RawIOBase):
    """Serves ``data`` but drops the connection after ``drop_after`` bytes, once."""

    def __init__(self, data: bytes, drop_after: int):
        self._data, self._drop_after, self._pos = data, drop_after, 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        if self._pos >= self._drop_after:
            raise ProtocolError("Connection broken: connection reset by peer")
        count = min(len(buffer), self._drop_after - self._pos)
        buffer[:count] = self._data[self._pos:self._pos + count]
        self._pos += count
        return count


def test_dropped_stream_resumes_at_its_offset(s3) -> None:
    backend, stubber = s3
    data = b"".join(b"line %06d\n" % i for i in range(10_000))
    cut = 3 * len(data) // 5
    stubber.add_response(
        "get_object",
        {"Body": StreamingBody(_DroppingStream(data, cut), len(data)), "ETag": '"v1"'},
        {"Bucket": "bucket", "Key": "key.jsonl"},
    )
    stubber.add_response(
        "get_object",
        {"Body": StreamingBody(io.BytesIO(data[cut:]), len(data) - cut), "ETag": '"v1"'},
        {"Bucket": "bucket", "Key": "key.jsonl", "Range": f"bytes={cut}-", "IfMatch": '"v1"'},
    )
    with backend.open_read(URI) as stream:
        assert stream.read() == data
