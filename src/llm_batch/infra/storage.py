"""One small interface over URIs: local paths (confined to configured roots) and s3://.

Local paths must resolve (symlinks followed) inside ``Settings.local_roots`` or llm-batch's own
local areas, buckets be in ``Settings.allowed_buckets`` when set; which paths a *user* may name
is stricter (``user_paths``). A written object appears only when the block exits without error.
Prefixes are directories: ``list_uris("s3://b/x")`` lists ``x/``, not ``xy``. Transient S3
failures are retried by tenacity alone (botocore's retries are off). Lines in (``iter_lines``,
``stored_lines``) and large writes out (``ChunkedWriter``) over any binary stream hold one chunk."""
from __future__ import annotations

import io
import os
import re
import secrets
import shutil
import tempfile
from collections.abc import Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path, PurePosixPath
from typing import IO, TYPE_CHECKING, Any, BinaryIO
from urllib.parse import unquote

from tenacity import Retrying, retry_if_exception, stop_after_attempt, wait_exponential

from llm_batch.core.config import Settings, get_settings

if TYPE_CHECKING:
    from boto3.s3.transfer import TransferConfig


class StorageError(Exception):
    """A storage operation failed; ``uri`` says on what."""

    def __init__(self, uri: str, message: str):
        super().__init__(f"{uri}: {message}")
        self.uri = uri


class ObjectNotFound(StorageError):
    pass


class AccessDenied(StorageError):
    """Also bad or missing credentials."""


class PathNotAllowed(StorageError):
    """Outside the roots or buckets, ``..``, a symlink escape, an unknown scheme."""


class SymlinkEscape(PathNotAllowed):
    """A path inside the roots whose symlinks lead outside them."""


class BucketNotFound(ObjectNotFound):
    """The bucket itself is missing (an ObjectNotFound whose message names the bucket)."""


# ``settings`` (every function): the roots, buckets and endpoint; default ``get_settings()``.

def open_read(uri: str, *, settings: Settings | None = None) -> AbstractContextManager[IO[bytes]]:
    """A buffered binary reader (read(n), readline(), iteration by line), streamed."""
    return _backend(uri, settings).open_read(uri)


def open_write(uri: str, *, settings: Settings | None = None) -> AbstractContextManager[IO[bytes]]:
    """A binary writer; the object is published only on clean exit."""
    return _backend(uri, settings).open_write(uri)


def read_bytes(uri: str, *, settings: Settings | None = None) -> bytes:
    with open_read(uri, settings=settings) as stream:
        return stream.read()


def read_range(uri: str, start: int, length: int, *, settings: Settings | None = None) -> bytes:
    """``length`` bytes of the object at ``uri`` from byte ``start`` (fewer past its end)."""
    return _backend(uri, settings).read_range(uri, start, length)


def write_bytes(uri: str, data: bytes, *, settings: Settings | None = None) -> None:
    with open_write(uri, settings=settings) as stream:
        stream.write(data)


def exists(uri: str, *, settings: Settings | None = None) -> bool:
    """About objects (files), not directories; so is ``size``."""
    return _backend(uri, settings).exists(uri)


def size(uri: str, *, settings: Settings | None = None) -> int:
    return _backend(uri, settings).size(uri)


def list_uris(prefix: str, *, settings: Settings | None = None) -> list[str]:
    return _backend(prefix, settings).list_uris(prefix)


def delete(uri: str, *, settings: Settings | None = None) -> None:
    """A missing object is a no-op."""
    _backend(uri, settings).delete(uri)


def delete_prefix(prefix: str, *, settings: Settings | None = None) -> None:
    """Never a whole root or bucket."""
    _backend(prefix, settings).delete_prefix(prefix)


def download_dir(prefix: str, dest: Path, *, settings: Settings | None = None) -> Path:
    """Copy every object under ``prefix`` into ``dest`` (the caller's cache, not confined),
    keeping relative paths; each file appears whole, one of the same size is skipped."""
    return _backend(prefix, settings).download_dir(prefix, Path(dest))


def check(uri: str, *, settings: Settings | None = None) -> str:
    """``uri`` canonical (local: absolute, symlinks resolved), or ``PathNotAllowed``; reads nothing."""
    return _backend(uri, settings).check(uri)


def is_s3(uri: str) -> bool:
    return uri[:5].lower() == "s3://"


def reset() -> None:
    """Forget cached backends and S3 clients (after settings or credentials change)."""
    _local_backend.cache_clear()
    _s3_backend.cache_clear()
    _s3_client.cache_clear()


_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
_ONE_SLASH_URI = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]+:/(?!/)")  # "s3:/bucket/key", a typo


def _backend(uri: str, settings: Settings | None = None) -> LocalStorage | S3Storage:
    if not isinstance(uri, str) or not uri:
        raise PathNotAllowed(repr(uri), "empty or not a string")
    match = _SCHEME.match(uri)
    scheme = match.group(1).lower() if match else "file"
    settings = settings or get_settings()
    if scheme == "file":  # the user roots and llm-batch's own local areas
        own = (settings.work_uri, settings.files_uri, settings.result_cache_uri)
        return _local_backend((*settings.local_roots, settings.home, *(Path(u) for u in own if u and not is_s3(u))))
    if scheme == "s3":
        # The AWS variables credentials come from: other values, another client.
        names = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE")
        return _s3_backend(_s3_endpoint_url(settings.s3_endpoint_url), tuple(settings.allowed_buckets),
                           tuple(map(os.environ.get, names)), os.getpid())
    raise PathNotAllowed(uri, f"unsupported scheme {scheme!r}: use a local path, file:// or s3://")


@lru_cache(maxsize=4)
def _s3_backend(endpoint_url: str | None, buckets: tuple[str, ...], credentials: tuple[str | None, ...],
                pid: int) -> S3Storage:
    return S3Storage(_s3_client(endpoint_url, credentials, pid), allowed_buckets=buckets)


class LocalStorage:
    def __init__(self, roots: tuple[Path, ...] | list[Path]):
        self.roots = tuple(Path(r).resolve() for r in roots)

    def path(self, uri: str) -> Path:
        """The resolved path ``uri`` names, or ``PathNotAllowed`` if it leaves the roots."""
        raw = file_uri_path(uri) if uri[:7].lower() == "file://" else uri
        if problem := spelling_problem(raw):
            raise PathNotAllowed(uri, problem)
        lexical = Path(raw) if os.path.isabs(raw) else Path.cwd() / raw
        resolved = lexical.resolve()
        if self._inside(resolved):
            return resolved
        if self._inside(Path(os.path.normpath(lexical))):
            raise SymlinkEscape(uri, f"a symlink leads outside the allowed roots to {resolved}")
        roots = ", ".join(map(str, self.roots)) or "(none configured)"
        raise PathNotAllowed(uri, f"outside the allowed roots {roots} (LLM_BATCH_LOCAL_ROOTS)")

    def check(self, uri: str) -> str:
        return str(self.path(uri))

    @contextmanager
    def open_read(self, uri: str) -> Iterator[IO[bytes]]:
        path = self.path(uri)
        with _os_errors(uri):
            stream = open(path, "rb")
        with stream:
            yield stream

    def read_range(self, uri: str, start: int, length: int) -> bytes:
        with self.open_read(uri) as stream:
            stream.seek(start)
            return stream.read(length)

    @contextmanager
    def open_write(self, uri: str) -> Iterator[IO[bytes]]:
        path = self.path(uri)
        tmp = path.with_name(f".{path.name}.{secrets.token_hex(6)}.tmp")
        with _os_errors(uri):
            path.parent.mkdir(parents=True, exist_ok=True)
            # Mode 0666 under the umask, like open(): the published file looks ordinary.
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        try:
            with os.fdopen(fd, "wb") as stream:
                yield stream
                stream.flush()
                os.fsync(stream.fileno())  # results files are checkpoints: make them durable
            with _os_errors(uri):
                os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)

    def exists(self, uri: str) -> bool:
        return self.path(uri).is_file()

    def size(self, uri: str) -> int:
        path = self.path(uri)
        with _os_errors(uri):
            if path.is_dir():
                raise StorageError(uri, "is a directory, not an object")
            return path.stat().st_size

    def list_uris(self, prefix: str) -> list[str]:
        root = self.path(prefix)
        if not root.is_dir():
            return []
        base = prefix.rstrip("/")
        found = []
        with _os_errors(prefix):
            for dirpath, _dirnames, filenames in os.walk(root):
                rel_dir = Path(dirpath).relative_to(root)
                found.extend(f"{base}/{(rel_dir / name).as_posix()}" for name in filenames)
        return sorted(found)

    def delete(self, uri: str) -> None:
        path = self.path(uri)
        with _os_errors(uri):
            path.unlink(missing_ok=True)

    def delete_prefix(self, prefix: str) -> None:
        path = self.path(prefix)
        if path in self.roots:
            raise PathNotAllowed(prefix, "refusing to delete a whole storage root")
        with _os_errors(prefix):
            if path.is_dir():
                shutil.rmtree(path)

    def download_dir(self, prefix: str, dest: Path) -> Path:
        uris = self.list_uris(prefix)
        if not uris:
            raise ObjectNotFound(prefix, "no files under this directory")
        base = prefix.rstrip("/") + "/"
        dest = dest.resolve()
        for uri in uris:
            source = self.path(uri)  # a symlink out of the roots is refused, not copied
            target = dest / uri[len(base):]
            with _os_errors(uri):
                if target.is_file() and target.stat().st_size == source.stat().st_size:
                    continue  # already there from an earlier copy
                target.parent.mkdir(parents=True, exist_ok=True)
                partial = target.with_name(f".{target.name}.partial")
                shutil.copyfile(source, partial)
                os.replace(partial, target)  # a file appears whole or not at all
        return dest

    def _inside(self, path: Path) -> bool:
        return any(path.is_relative_to(root) for root in self.roots)


_local_backend = lru_cache(maxsize=4)(LocalStorage)


def spelling_problem(raw: str) -> str | None:
    """What is wrong with how a local path is written, whatever the filesystem holds."""
    if not raw or "\0" in raw:
        return "empty path or NUL byte in path"
    if ".." in PurePosixPath(raw).parts:
        return "'..' is not allowed in paths"
    if raw.startswith("~"):  # whose home would it be? (the API server's, not the user's)
        return "'~' is not expanded: give an absolute path"
    if _ONE_SLASH_URI.match(raw):
        return f"looks like a URI with one slash: write {raw.split(':', 1)[0]}://..."
    return None


def file_uri_path(uri: str) -> str:
    """The local path a ``file://`` URI names (``PathNotAllowed`` unless file:///abs)."""
    rest = uri[len("file://"):]
    if rest.startswith("localhost/"):
        rest = rest[len("localhost"):]
    if not rest.startswith("/"):
        raise PathNotAllowed(uri, "a file:// URI must be file:///absolute/path")
    return unquote(rest)


@contextmanager
def _os_errors(uri: str) -> Iterator[None]:
    try:
        yield
    except FileNotFoundError as exc:
        raise ObjectNotFound(uri, "no such file or directory") from exc
    except PermissionError as exc:
        raise AccessDenied(uri, f"permission denied ({exc.strerror})") from exc
    except IsADirectoryError as exc:
        raise StorageError(uri, "is a directory, not an object") from exc
    except OSError as exc:
        raise StorageError(uri, exc.strerror or str(exc)) from exc


_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
_DENIED_CODES = {
    "AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken",
    "InvalidToken", "TokenRefreshRequired", "AllAccessDisabled", "AccountProblem", "403",
}
_THROTTLE_CODES = {
    "Throttling", "ThrottlingException", "SlowDown", "RequestLimitExceeded",
    "RequestTimeout", "InternalError", "ServiceUnavailable",
}
# Few attempts, short waits: a batch step that still fails is retried by Airflow.
RETRY_ATTEMPTS = 4
_SPOOL_BYTES = 8 * 1024**2
_READ_BUFFER = 1024**2


def s3_location(uri: str, allowed_buckets: tuple[str, ...] | list[str]) -> S3Location:
    """``s3://bucket/key`` confined to `allowed_buckets` (none: any bucket); no request is made."""
    bucket, _, key = uri[len("s3://"):].partition("/")
    if not _BUCKET.match(bucket):
        raise PathNotAllowed(uri, f"invalid bucket name {bucket!r}")
    if allowed_buckets and bucket not in allowed_buckets:
        raise PathNotAllowed(uri, f"bucket {bucket!r} is not one of the allowed buckets "
                                  f"{', '.join(allowed_buckets)} (LLM_BATCH_ALLOWED_BUCKETS)")
    return S3Location(bucket, key)


@dataclass(frozen=True)
class S3Location:
    bucket: str
    key: str

    def uri(self, key: str | None = None) -> str:
        return f"s3://{self.bucket}/{self.key if key is None else key}"

    @property
    def dir_prefix(self) -> str:
        return self.key if not self.key or self.key.endswith("/") else self.key + "/"


def _s3_endpoint_url(configured: str | None, environ: Mapping[str, str] | None = None) -> str | None:
    """Settings.s3_endpoint_url, else AWS's own variables; None: AWS itself."""
    environ = os.environ if environ is None else environ
    return configured or environ.get("AWS_ENDPOINT_URL_S3") or environ.get("AWS_ENDPOINT_URL")


@lru_cache(maxsize=4)
def _s3_client(endpoint_url: str | None, credentials: tuple[str | None, ...], pid: int) -> Any:
    """Keyed by ``pid`` too: clients are thread-safe but not fork-safe."""
    return s3_client(endpoint_url)


def s3_client(endpoint_url: str | None, session: Any = None) -> Any:
    """``session`` default: a new one (the standard AWS credential chain)."""
    import boto3  # heavy
    from botocore.config import Config  # heavy

    config = Config(retries={"total_max_attempts": 1, "mode": "standard"},  # tenacity retries instead
                    connect_timeout=10, read_timeout=60, s3={"addressing_style": "path"} if endpoint_url else None)
    return (session or boto3.session.Session()).client("s3", endpoint_url=endpoint_url, config=config)


class S3Storage:
    def __init__(self, client: Any, allowed_buckets: tuple[str, ...] | list[str] = (),
                 transfer_config: TransferConfig | None = None):
        from boto3.s3.transfer import TransferConfig  # heavy

        self.client = client
        self.allowed_buckets = tuple(allowed_buckets)
        self.transfer_config = transfer_config or TransferConfig()

    def location(self, uri: str) -> S3Location:
        return s3_location(uri, self.allowed_buckets)

    def check(self, uri: str) -> str:
        self.location(uri)
        return uri

    def object_location(self, uri: str) -> S3Location:
        loc = self.location(uri)
        if not loc.key or loc.key.endswith("/"):
            raise StorageError(uri, "names a prefix, not an object")
        return loc

    @contextmanager
    def open_read(self, uri: str) -> Iterator[IO[bytes]]:
        loc = self.object_location(uri)
        with self._errors(uri, loc):
            reader = _S3Reader(self, uri, loc)
        with io.BufferedReader(reader, buffer_size=_READ_BUFFER) as stream:
            yield stream

    def read_range(self, uri: str, start: int, length: int) -> bytes:
        if length <= 0:
            return b""
        loc = self.object_location(uri)
        with self._errors(uri, loc):
            reply = self.call("get_object", Bucket=loc.bucket, Key=loc.key, Range=f"bytes={start}-{start + length - 1}")
            return reply["Body"].read()

    @contextmanager
    def open_write(self, uri: str) -> Iterator[IO[bytes]]:
        loc = self.object_location(uri)
        with tempfile.SpooledTemporaryFile(max_size=_SPOOL_BYTES) as spool:
            yield spool
            with self._errors(uri, loc):
                self._retrying(self._upload, spool, loc)

    def exists(self, uri: str) -> bool:
        try:
            self.size(uri)
        except BucketNotFound:
            raise  # a misnamed bucket is a configuration error, not a missing object
        except ObjectNotFound:
            return False
        return True

    def size(self, uri: str) -> int:
        loc = self.object_location(uri)
        with self._errors(uri, loc):
            head = self.call("head_object", Bucket=loc.bucket, Key=loc.key)
        return int(head["ContentLength"])

    def list_uris(self, prefix: str) -> list[str]:
        loc = self.location(prefix)
        return sorted(loc.uri(key) for key, _size in self._objects(prefix, loc))

    def delete(self, uri: str) -> None:
        loc = self.object_location(uri)
        with self._errors(uri, loc):
            self.call("delete_object", Bucket=loc.bucket, Key=loc.key)

    def delete_prefix(self, prefix: str) -> None:
        loc = self.location(prefix)
        if not loc.dir_prefix:
            raise PathNotAllowed(prefix, "refusing to delete a whole bucket")
        keys = [key for key, _size in self._objects(prefix, loc)]
        for start in range(0, len(keys), 1000):  # DeleteObjects takes at most 1000 keys
            batch = [{"Key": k} for k in keys[start:start + 1000]]
            with self._errors(prefix, loc):
                reply = self.call("delete_objects", Bucket=loc.bucket, Delete={"Objects": batch, "Quiet": True})
            if reply.get("Errors"):
                first = reply["Errors"][0]
                raise StorageError(loc.uri(first.get("Key", "")),
                                   f"delete failed: {first.get('Code')} {first.get('Message')}")

    def download_dir(self, prefix: str, dest: Path) -> Path:
        loc = self.location(prefix)
        objects = list(self._objects(prefix, loc))
        if not objects:
            raise ObjectNotFound(prefix, "no objects under this prefix")
        dest = dest.resolve()
        for key, object_size in objects:
            target = (dest / key[len(loc.dir_prefix):]).resolve()
            if not target.is_relative_to(dest) or target == dest:
                raise PathNotAllowed(loc.uri(key), f"key would be written outside {dest}")
            uri = loc.uri(key)
            with _os_errors(str(target)):
                target.parent.mkdir(parents=True, exist_ok=True)
            if target.is_file() and target.stat().st_size == object_size:
                continue  # already there from an earlier download
            with self._errors(uri, S3Location(loc.bucket, key)):
                # s3transfer writes a temp file and renames it: a file appears whole or not.
                self._retrying(self.client.download_file, loc.bucket, key, str(target), Config=self.transfer_config)
        return dest

    def call(self, operation: str, **kwargs: Any) -> Any:
        return self._retrying(getattr(self.client, operation), **kwargs)

    def _retrying(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        retrying = Retrying(retry=retry_if_exception(_is_transient), stop=stop_after_attempt(RETRY_ATTEMPTS),
                            wait=wait_exponential(multiplier=0.2, max=2), reraise=True)
        return retrying(fn, *args, **kwargs)

    def _upload(self, spool: IO[bytes], loc: S3Location) -> None:
        spool.seek(0)  # also on a retry
        self.client.upload_fileobj(_KeptOpen(spool), loc.bucket, loc.key, Config=self.transfer_config)

    def _objects(self, prefix: str, loc: S3Location) -> Iterator[tuple[str, int]]:
        with self._errors(prefix, loc):
            token: dict[str, str] = {}
            while True:
                page = self.call("list_objects_v2", Bucket=loc.bucket, Prefix=loc.dir_prefix, **token)
                for item in page.get("Contents", []):
                    if not item["Key"].endswith("/"):  # skip "directory" marker objects
                        yield item["Key"], int(item["Size"])
                if not page.get("IsTruncated"):
                    return
                token = {"ContinuationToken": page["NextContinuationToken"]}

    @contextmanager
    def _errors(self, uri: str, loc: S3Location) -> Iterator[None]:
        from boto3.exceptions import Boto3Error, RetriesExceededError  # heavy
        from botocore.exceptions import BotoCoreError, ClientError  # heavy

        try:
            yield
        except RetriesExceededError as exc:
            raise self._translate(uri, loc, exc.last_exception) from exc
        except (ClientError, BotoCoreError, Boto3Error) as exc:
            raise self._translate(uri, loc, exc) from exc

    def _translate(self, uri: str, loc: S3Location, exc: BaseException) -> StorageError:
        from botocore import exceptions as boto  # heavy

        if isinstance(exc, (boto.NoCredentialsError, boto.PartialCredentialsError)):
            return AccessDenied(uri, f"no usable AWS credentials ({exc}); set them by the "
                                     "standard chain (AWS_* env, ~/.aws, instance role)")
        if isinstance(exc, boto.EndpointConnectionError):
            return StorageError(uri, f"cannot reach the S3 endpoint: {exc}")
        if not isinstance(exc, boto.ClientError):
            return StorageError(uri, f"{type(exc).__name__}: {exc}")
        code, status = _error_code(exc), _status(exc)
        message = exc.response.get("Error", {}).get("Message") or code
        if code == "NoSuchBucket":
            return BucketNotFound(uri, f"bucket {loc.bucket!r} does not exist")
        if code in _DENIED_CODES or status == 403:
            return AccessDenied(uri, f"access denied ({code}: {message})")
        if code in {"NoSuchKey", "NotFound", "404"} or status == 404:
            # HEAD answers a bare 404 for a missing bucket too: ask which it is.
            if not self._bucket_exists(loc.bucket):
                return BucketNotFound(uri, f"bucket {loc.bucket!r} does not exist")
            return ObjectNotFound(uri, "no such object")
        return StorageError(uri, f"{code}: {message}")

    def _bucket_exists(self, bucket: str) -> bool:
        from botocore.exceptions import BotoCoreError, ClientError  # heavy

        try:
            self.call("head_bucket", Bucket=bucket)
        except ClientError as exc:
            return _status(exc) != 404
        except BotoCoreError:
            return True  # unknown: let the caller report the object as missing
        return True


class _KeptOpen:
    """A file whose close() is a no-op: s3transfer closes what it uploads, a retry rereads it."""

    def __init__(self, file: IO[bytes]):
        self._file = file

    def __getattr__(self, name: str) -> Any:
        return getattr(self._file, name)

    def close(self) -> None:
        pass


class _S3Reader(io.RawIOBase):
    """The raw side of an object's stream: reads the StreamingBody, resumes on drop."""

    def __init__(self, storage: S3Storage, uri: str, loc: S3Location):
        super().__init__()
        self._storage, self._uri, self._loc = storage, uri, loc
        self._position = 0
        reply = storage.call("get_object", Bucket=loc.bucket, Key=loc.key)
        self._etag = reply.get("ETag")
        self._body = reply["Body"]

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        for attempt in range(1, RETRY_ATTEMPTS + 1):
            try:
                count = self._body.readinto(buffer)
                self._position += count
                return count
            except Exception as exc:
                if attempt == RETRY_ATTEMPTS or not _is_transient(exc):
                    raise self._storage._translate(self._uri, self._loc, exc) from exc
                self._reopen()
        raise AssertionError("unreachable")

    def _reopen(self) -> None:
        """The same version of the object, from where the stream broke."""
        self._body.close()
        with self._storage._errors(self._uri, self._loc):
            reply = self._storage.call(
                "get_object", Bucket=self._loc.bucket, Key=self._loc.key,
                Range=f"bytes={self._position}-", **({"IfMatch": self._etag} if self._etag else {}),
            )
        self._body = reply["Body"]

    def close(self) -> None:
        if not self.closed:
            self._body.close()
        super().close()


def _error_code(exc: Any) -> str:
    return str(exc.response.get("Error", {}).get("Code", ""))


def _status(exc: Any) -> int | None:
    return exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")


def _is_transient(exc: BaseException) -> bool:
    """Throttling, 5xx and dropped/timed-out connections: worth another try."""
    from botocore.exceptions import ClientError, ConnectionError, HTTPClientError, IncompleteReadError  # heavy

    if isinstance(exc, ClientError):
        status = _status(exc) or 0
        return _error_code(exc) in _THROTTLE_CODES or status == 429 or status >= 500
    return isinstance(exc, (ConnectionError, HTTPClientError, IncompleteReadError))


CHUNK_BYTES = 1 << 16  # per open stream: merge holds 2 per shard, so keep it small


def iter_lines(stream: BinaryIO, chunk_bytes: int = CHUNK_BYTES) -> Iterator[bytes]:
    """The lines of ``stream`` without their newline; a last line without one is kept. A
    long line is gathered in pieces and joined once: linear time, not quadratic."""
    pending: list[bytes] = []
    while chunk := stream.read(chunk_bytes):
        if b"\n" not in chunk:
            pending.append(chunk)
            continue
        lines = chunk.split(b"\n")
        if pending:
            pending.append(lines[0])
            lines[0] = b"".join(pending)
            pending.clear()
        tail = lines.pop()
        if tail:
            pending.append(tail)
        yield from lines
    if pending:
        yield b"".join(pending)


def stored_lines(uri: str) -> Iterator[bytes]:
    """The non-blank lines of the stored file ``uri``, streamed."""
    with open_read(uri) as stream:
        for line in iter_lines(stream):
            if line.strip():
                yield line


class ChunkedWriter:
    """Small writes in, chunks of about ``chunk_bytes`` out (an S3 writer may send each write)."""

    def __init__(self, stream: BinaryIO, chunk_bytes: int = CHUNK_BYTES):
        self._stream = stream
        self._chunk_bytes = chunk_bytes
        self._parts: list[bytes] = []
        self._size = 0

    def write(self, data: bytes) -> None:
        self._parts.append(data)
        self._size += len(data)
        if self._size >= self._chunk_bytes:
            self.flush()

    def flush(self) -> None:
        if self._parts:
            self._stream.write(b"".join(self._parts))
            self._parts.clear()
            self._size = 0
