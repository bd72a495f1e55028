"""File objects: the records of uploaded inputs and of jobs' outputs and errors (the ``files``
table; the content, the caller's to delete, is in storage at each record's ``uri``). Deleting
only marks the record (``deleted_at``)."""

from __future__ import annotations

import uuid
from datetime import datetime, timedelta

from sqlalchemy import select

from llm_batch.core.snapshots import FILE_KINDS, FileObject
from llm_batch.infra.jobstore.errors import FileNotFound
from llm_batch.infra.jobstore.models import FILES
from llm_batch.infra.jobstore.paging import check_page, matching, ordering, owned, page
from llm_batch.infra.jobstore.repository import Repository, from_row, require_aware, require_non_negative, utcnow

_file = from_row(FileObject)


def new_file_id() -> str:
    return f"file-{uuid.uuid4().hex}"


class FileRepository(Repository):
    def create_file(
        self, *, owner: str, purpose: str, filename: str, bytes: int, uri: str, kind: str = "input",
        job_id: str | None = None, expires_at: datetime | None = None, id: str | None = None,
        expires_after: timedelta | None = None,
    ) -> FileObject:
        """Record a file object; `expires_after` sets expires_at to created_at + expires_after."""
        if kind not in FILE_KINDS:
            raise ValueError(f"file kind {kind!r} is unknown; use one of {', '.join(FILE_KINDS)}")
        require_non_negative({"bytes": bytes})
        require_aware(expires_at=expires_at)
        created_at = utcnow()
        if expires_after is not None:
            expires_at = created_at + expires_after
        values = dict(id=id or new_file_id(), owner=owner, purpose=purpose, filename=filename, bytes=bytes, uri=uri,
                      kind=kind, job_id=job_id, created_at=created_at, expires_at=expires_at)
        return _file(self._insert(FILES, values, FILES.c))

    def get_file(self, file_id: str, owner: str | None = None, include_deleted: bool = False) -> FileObject | None:
        """The file object, or None if unknown, someone else's, or deleted (unless asked)."""
        filters = owned(FILES, file_id, owner)
        if not include_deleted:
            filters.append(FILES.c.deleted_at.is_(None))
        return self._read_one(select(FILES).where(*filters), _file)

    def list_files(
        self, owner: str | None = None, purpose: str | None = None, kind: str | None = None, job_id: str | None = None,
        created_before: datetime | None = None, include_deleted: bool = False, order_by: str = "-created_at",
        limit: int = 100, offset: int = 0, after: str | None = None,
    ) -> tuple[list[FileObject], int]:
        """One page of file objects and the total matching (paged as list_jobs)."""
        check_page(limit, offset)
        require_aware(created_before=created_before)
        order = ordering(FILES, order_by, {"created_at"})
        filters = matching(FILES, owner=owner, purpose=purpose, kind=kind, job_id=job_id)
        if created_before is not None:
            filters.append(FILES.c.created_at < created_before)
        if not include_deleted:
            filters.append(FILES.c.deleted_at.is_(None))
        with self._transaction(write=False) as connection:
            rows, total = page(connection, FILES, filters, order, limit, offset, after, owner=owner)
            return [_file(r) for r in rows], total

    def mark_file_deleted(self, file_id: str, owner: str | None = None) -> FileObject:
        """Set deleted_at (once; repeating is harmless)."""
        missing = FileNotFound(f"no file {file_id!r}")
        return _file(self._stamp_once(FILES, "deleted_at", file_id, owner, FILES.c, missing))

    def list_expiring_files(self, expires_before: datetime, limit: int = 500) -> list[FileObject]:
        """Files not yet deleted whose expires_at is before `expires_before`, oldest first."""
        check_page(limit, 0)
        require_aware(expires_before=expires_before)
        query = (
            select(FILES)
            .where(FILES.c.deleted_at.is_(None), FILES.c.expires_at.is_not(None), FILES.c.expires_at < expires_before)
            .order_by(FILES.c.expires_at, FILES.c.id)
            .limit(limit)
        )
        return self._read_all(query, _file)
