"""Which stored files a job may read as its batch input: one rule for every way a job is
made from file ids (OpenAI's and Mistral's routes, the native ``/v1/jobs``, a DAG run's
``input_file_ids``).

Every dialect uploads batch input with purpose ``batch`` (OpenAI's and Mistral's name), and
only such an upload is checked as JSONL; an ``ocr`` or ``audio`` upload is media that a
line names, and a job's own results are ``batch_output`` / ``batch_error``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the store pulls in SQLAlchemy: DAG files must parse without it
    from llm_batch.infra.jobstore import FileObject

BATCH_INPUT_PURPOSES = frozenset({"batch"})


def refusal(file: FileObject) -> str | None:
    """Why `file` may not be a job's input, or None if it may."""
    if file.purpose in BATCH_INPUT_PURPOSES:
        return None
    what = f"is a job's {file.kind} file" if file.kind != "input" else f"was uploaded with purpose {file.purpose!r}"
    allowed = ", ".join(repr(p) for p in sorted(BATCH_INPUT_PURPOSES))
    return f"file {file.id!r} {what}, not a batch input: a job reads only files uploaded with purpose {allowed}"
