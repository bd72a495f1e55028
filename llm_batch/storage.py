"""One small interface over URIs: local paths (confined to configured roots) and s3://.

CONTRACT (implementations must keep it; other modules code against these names):

    open_read(uri) -> context manager yielding a binary stream (streamed, never slurped)
    open_write(uri) -> context manager yielding a binary stream; the object appears only
                       when the block exits without error (atomic publish: temp file +
                       rename locally, multipart upload on S3 aborted on error)
    read_bytes(uri) -> bytes ; write_bytes(uri, data)   (small objects: progress, reports)
    exists(uri) -> bool ; size(uri) -> int
    list_uris(prefix) -> sorted list of URIs under prefix (recursive)
    delete(uri) ; delete_prefix(prefix)
    download_dir(prefix, dest: Path) -> Path   (a model checkpoint into the local cache)

Errors are ``StorageError`` subclasses whose message names the URI:
    ObjectNotFound, AccessDenied (also bad credentials), PathNotAllowed (outside roots or
    buckets, ``..``, symlink escapes), StorageError (anything else).
"""

from __future__ import annotations


class StorageError(Exception):
    """A storage operation failed; ``uri`` says on what."""

    def __init__(self, uri: str, message: str):
        super().__init__(f"{uri}: {message}")
        self.uri = uri


class ObjectNotFound(StorageError):
    pass


class AccessDenied(StorageError):
    pass


class PathNotAllowed(StorageError):
    pass
