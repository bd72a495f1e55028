"""llm_batch.infra.storage against a real S3 server (SeaweedFS, signatures checked)."""

from __future__ import annotations

import hashlib
import os
import tracemalloc
from pathlib import Path

import pytest

from llm_batch.core.config import get_settings
from llm_batch.infra import storage
from llm_batch.infra.storage import AccessDenied, ObjectNotFound, PathNotAllowed, StorageError

pytestmark = pytest.mark.s3

MIB = 1024**2


def test_round_trip_and_metadata(s3_bucket: str) -> None:
    uri = f"s3://{s3_bucket}/jobs/j1/validation.json"
    storage.write_bytes(uri, b'{"total": 3}')

    assert storage.read_bytes(uri) == b'{"total": 3}'
    assert storage.exists(uri)
    assert storage.size(uri) == 12
    assert not storage.exists(f"s3://{s3_bucket}/jobs/j1/absent.json")


def test_open_read_streams_lines(s3_bucket: str) -> None:
    uri = f"s3://{s3_bucket}/input.jsonl"
    lines = [f'{{"custom_id": "r{i}"}}\n'.encode() for i in range(5000)]
    with storage.open_write(uri) as out:
        out.writelines(lines)

    with storage.open_read(uri) as stream:
        assert next(iter(stream)) == lines[0]  # line iteration, not boto's 1 KiB chunks
        rest = list(stream)
    assert [lines[0], *rest] == lines


def test_failed_write_publishes_nothing(s3_bucket: str) -> None:
    uri = f"s3://{s3_bucket}/output.jsonl"
    with pytest.raises(RuntimeError, match="worker died"):
        with storage.open_write(uri) as out:
            out.write(b"partial line\n")
            raise RuntimeError("worker died")

    assert not storage.exists(uri)
    assert storage.list_uris(f"s3://{s3_bucket}") == []


def test_multipart_sized_object(s3_server, s3_bucket: str) -> None:
    from boto3.s3.transfer import TransferConfig

    # Lowered threshold/parts keep a 20 MiB object multipart (4 parts) yet fast.
    small_parts = TransferConfig(multipart_threshold=5 * MIB, multipart_chunksize=5 * MIB)
    backend = storage.S3Storage(storage.s3_client(s3_server.endpoint_url), transfer_config=small_parts)
    uri = f"s3://{s3_bucket}/big/part.bin"
    data = os.urandom(MIB) * 20
    with backend.open_write(uri) as out:
        for offset in range(0, len(data), MIB):
            out.write(data[offset:offset + MIB])

    etag = s3_server.client().head_object(Bucket=s3_bucket, Key="big/part.bin")["ETag"]
    assert etag.strip('"').endswith("-4")  # a multipart upload of 4 parts
    assert storage.size(uri) == len(data)
    digest = hashlib.sha256()
    tracemalloc.start()
    try:
        with storage.open_read(uri) as stream:
            while chunk := stream.read(MIB):
                digest.update(chunk)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert digest.digest() == hashlib.sha256(data).digest()
    assert peak < 8 * MIB  # streamed: the 20 MiB body never sits in memory at once


def test_list_and_delete_prefix(s3_bucket: str) -> None:
    base = f"s3://{s3_bucket}/work/job-1"
    names = ["shards/00001/requests.jsonl", "shards/00000/requests.jsonl", "validated.jsonl"]
    for name in names:
        storage.write_bytes(f"{base}/{name}", b"x")
    storage.write_bytes(f"s3://{s3_bucket}/work/job-10/validated.jsonl", b"other job")

    assert storage.list_uris(base) == sorted(f"{base}/{n}" for n in names)
    assert storage.list_uris(f"{base}/shards/") == [f"{base}/{n}" for n in sorted(names[:2])]
    assert storage.list_uris(f"s3://{s3_bucket}/nothing-here") == []

    storage.delete_prefix(base)
    assert storage.list_uris(base) == []
    assert storage.list_uris(f"s3://{s3_bucket}/work") == [f"s3://{s3_bucket}/work/job-10/validated.jsonl"]
    with pytest.raises(PathNotAllowed, match="whole bucket"):
        storage.delete_prefix(f"s3://{s3_bucket}")


def test_delete_object(s3_bucket: str) -> None:
    uri = f"s3://{s3_bucket}/cancel"
    storage.write_bytes(uri, b"")
    assert storage.exists(uri)
    storage.delete(uri)
    assert not storage.exists(uri)
    storage.delete(uri)  # idempotent


def test_missing_key_names_the_uri(s3_bucket: str) -> None:
    uri = f"s3://{s3_bucket}/no/such/key.jsonl"
    with pytest.raises(ObjectNotFound, match="no such object") as info:
        storage.read_bytes(uri)
    assert info.value.uri == uri and uri in str(info.value)
    with pytest.raises(ObjectNotFound):
        storage.size(uri)


def test_missing_bucket_names_the_bucket(s3_bucket: str) -> None:
    uri = "s3://no-such-bucket-llm-batch/input.jsonl"
    for operation in (storage.read_bytes, storage.size, storage.exists, storage.list_uris):
        with pytest.raises(ObjectNotFound, match="bucket 'no-such-bucket-llm-batch' does not exist"):
            operation(uri)
    with pytest.raises(ObjectNotFound, match="no-such-bucket-llm-batch"):
        storage.write_bytes(uri, b"x")


def _read(backend: storage.S3Storage, uri: str) -> bytes:
    with backend.open_read(uri) as stream:
        return stream.read()


def test_wrong_secret_is_access_denied(s3_wrong_secret: str) -> None:
    uri = f"s3://{s3_wrong_secret}/present.txt"
    for operation in (storage.read_bytes, storage.size, storage.list_uris):
        with pytest.raises(AccessDenied) as info:
            operation(uri)
        assert info.value.uri == uri
    with pytest.raises(AccessDenied):
        storage.write_bytes(f"s3://{s3_wrong_secret}/new.txt", b"x")


def test_no_credentials_is_access_denied(s3_server, s3_bucket: str) -> None:
    import boto3
    import botocore.session
    from botocore.credentials import CredentialResolver

    nowhere = botocore.session.Session()
    nowhere.register_component("credential_provider", CredentialResolver(providers=[]))  # a chain finding none
    backend = storage.S3Storage(storage.s3_client(s3_server.endpoint_url, boto3.session.Session(
        botocore_session=nowhere, region_name="us-east-1")))
    with pytest.raises(AccessDenied, match="credentials"):
        _read(backend, f"s3://{s3_bucket}/x")


def test_allowed_buckets_confine(s3_bucket: str) -> None:
    confined = get_settings().model_copy(update={"allowed_buckets": [s3_bucket, "other-bucket"]})
    storage.write_bytes(f"s3://{s3_bucket}/ok.txt", b"ok", settings=confined)
    assert storage.check(f"s3://{s3_bucket}/ok.txt", settings=confined) == f"s3://{s3_bucket}/ok.txt"
    with pytest.raises(PathNotAllowed, match="not one of the allowed buckets"):
        storage.check("s3://elsewhere/data.jsonl", settings=confined)
    with pytest.raises(PathNotAllowed):
        storage.read_bytes("s3://elsewhere/data.jsonl", settings=confined)


def test_download_dir_of_a_prefix(s3_bucket: str, tmp_path: Path) -> None:
    prefix = f"s3://{s3_bucket}/models/tiny"
    files = {"config.json": b"{}", "tokenizer/tokenizer.json": b'{"v": 1}', "model.safetensors": os.urandom(4096)}
    for name, data in files.items():
        storage.write_bytes(f"{prefix}/{name}", data)
    storage.write_bytes(f"s3://{s3_bucket}/models/tiny-other/config.json", b"not this one")

    dest = storage.download_dir(prefix, tmp_path / "cache" / "tiny")

    assert dest == (tmp_path / "cache" / "tiny").resolve()
    got = {p.relative_to(dest).as_posix(): p.read_bytes() for p in dest.rglob("*") if p.is_file()}
    assert got == files
    # A second call finds the files there and leaves them be.
    mtime = (dest / "config.json").stat().st_mtime_ns
    assert storage.download_dir(prefix, dest) == dest
    assert (dest / "config.json").stat().st_mtime_ns == mtime
    with pytest.raises(ObjectNotFound, match="no objects"):
        storage.download_dir(f"s3://{s3_bucket}/models/absent", tmp_path / "absent")


def test_endpoint_from_aws_endpoint_url(s3_server, s3_bucket: str) -> None:
    # Without LLM_BATCH_S3_ENDPOINT_URL, AWS's own variables name the endpoint: the S3 one,
    # else the one of every service.
    url = s3_server.endpoint_url
    assert storage._s3_endpoint_url(None, {"AWS_ENDPOINT_URL": url}) == url
    assert storage._s3_endpoint_url(None, {"AWS_ENDPOINT_URL_S3": url, "AWS_ENDPOINT_URL": "http://other"}) == url
    assert storage._s3_endpoint_url("http://configured", {"AWS_ENDPOINT_URL_S3": url}) == "http://configured"
    # And storage goes there: s3_bucket names the server in AWS_ENDPOINT_URL_S3 only.
    unset = get_settings().model_copy(update={"s3_endpoint_url": None})
    storage.write_bytes(f"s3://{s3_bucket}/via-aws-env.txt", b"ok", settings=unset)
    assert storage.read_bytes(f"s3://{s3_bucket}/via-aws-env.txt", settings=unset) == b"ok"


def test_unreachable_endpoint_is_a_storage_error(s3_bucket: str, monkeypatch: pytest.MonkeyPatch) -> None:
    refused = get_settings().model_copy(update={"s3_endpoint_url": "http://127.0.0.1:9"})  # discard port
    monkeypatch.setattr(storage, "RETRY_ATTEMPTS", 2)
    with pytest.raises(StorageError, match="cannot reach the S3 endpoint") as info:
        storage.size(f"s3://{s3_bucket}/x", settings=refused)
    assert info.value.uri == f"s3://{s3_bucket}/x"


def test_the_server_does_not_run_out_of_volumes_for_new_buckets(s3_server) -> None:
    """Every bucket is a SeaweedFS collection: one volume each (not the default seven), and a
    deleted bucket gives its volumes back, so a long suite or a long-lived dev stack never
    meets 'InternalError' on a PUT to its newest bucket."""
    from tests.e2e.conftest import wait_until
    from tests.fixtures.s3 import _drop_bucket, _new_bucket

    data = s3_server.log.parent / "data"
    buckets = [_new_bucket(s3_server) for _ in range(3)]
    for bucket in buckets:
        s3_server.client().put_object(Bucket=bucket, Key="k", Body=b"v")
        assert len(list(data.glob(f"{bucket}_*.dat"))) == 1

    for bucket in buckets:
        _drop_bucket(s3_server, bucket)
    wait_until("the deleted buckets' volumes gone", lambda: not [
        p for b in buckets for p in data.glob(f"{b}_*.dat")], 10, poll=0.2)
