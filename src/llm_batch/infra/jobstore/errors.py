"""What the job store raises."""

from __future__ import annotations


class JobStoreError(Exception):
    pass


class JobNotFound(JobStoreError, LookupError):
    pass


class FileNotFound(JobStoreError, LookupError):
    pass


class ApiKeyNotFound(JobStoreError, LookupError):
    pass


class AdapterNotFound(JobStoreError, LookupError):
    pass


class DuplicateId(JobStoreError, ValueError):
    pass


class AdapterExists(DuplicateId):
    """An owner already has an adapter of that name."""


class InvalidCursor(JobStoreError, ValueError):
    pass


class ConcurrentUpdate(JobStoreError):
    """A compare-and-set kept losing to other writers (should not happen in practice)."""


class JobStoreUnhealthy(JobStoreError):
    """A new connection could not read and write the store (the message names the step)."""
