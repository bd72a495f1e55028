"""Which stored files a job may read as its batch input: one rule for every route that makes
a job from file ids. Only a ``batch`` upload was checked as JSONL (``ocr`` / ``audio`` ones
are media a line names; a job's own results are ``batch_output`` / ``batch_error``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the store pulls in SQLAlchemy: DAG files must parse without it
    from llm_batch.infra.jobstore import FileObject

def refusal(file: FileObject) -> str | None:
    """Why `file` may not be a job's input, or None if it may."""
    if file.purpose == "batch":
        return None
    what = f"is a job's {file.kind} file" if file.kind != "input" else f"was uploaded with purpose {file.purpose!r}"
    return f"file {file.id!r} {what}, not a batch input: a job reads only files uploaded with purpose 'batch'"
