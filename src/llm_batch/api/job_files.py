"""The first lines of a job's output and error files, as the "Batch jobs" page shows them.

Rows are parsed here, on the server, from whichever dialect's line shape the file holds, and
the page writes every value as text (never markup). A line that does not parse is shown as
its text. Files are read through ``llm_batch.infra.storage`` and never more than the first
lines the page asks for.
"""

from __future__ import annotations

from typing import Any

import orjson

from llm_batch.infra import storage
from llm_batch.infra.jobstore import JobStore

ERROR_LINE_CHARS = 2000  # of an error line kept (a message longer than this is cut)
RESULT_LINE_CHARS = 256 * 1024  # of a result line read (a longer one is shown as its text)
EXCERPT_CHARS = 300  # of an answer shown


def first_lines(store: JobStore, file_id: str | None, limit: int, chars: int = ERROR_LINE_CHARS) -> list[str]:
    """The first `limit` lines of a stored file, each cut at `chars`; [] without one (or once
    it was deleted)."""
    file = store.get_file(file_id) if file_id else None
    if file is None or file.deleted:
        return []
    lines: list[str] = []
    try:
        with storage.open_read(file.uri) as stream:
            for raw in stream:
                lines.append(raw.decode("utf-8", "replace").rstrip("\r\n")[:chars])
                if len(lines) >= limit:
                    break
    except storage.StorageError as exc:
        return [f"(the file could not be read: {exc})"]
    return lines


def _record(raw: str) -> dict[str, Any] | None:
    try:
        record = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None
    return record if isinstance(record, dict) else None


def _dict(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _text(value: Any) -> str | None:
    return None if value is None else str(value)


def error_row(raw: str) -> dict[str, Any]:
    """One error line: line, custom_id, code, message (each dialect has them in its own place)."""
    record = _record(raw)
    if record is None:
        return {"line": None, "custom_id": None, "code": None, "message": raw}
    body = _dict(_dict(record.get("response")).get("body"))
    error = next((e for e in (record.get("error"), body.get("error")) if isinstance(e, dict)), {})
    return {"line": record.get("line") if isinstance(record.get("line"), int) else None,
            "custom_id": _text(record.get("custom_id")), "code": _text(error.get("code")),
            "message": _text(error.get("message")) or raw}


def _answer(body: dict[str, Any]) -> str:
    """What a result says, in short: a chat message or completion text, an embedding's size,
    else the body as JSON."""
    choices = body.get("choices") if isinstance(body.get("choices"), list) else []
    first = _dict(choices[0]) if choices else {}
    if isinstance(_dict(first.get("message")).get("content"), str):
        text = first["message"]["content"]
    elif isinstance(first.get("text"), str):
        text = first["text"]
    elif isinstance(body.get("data"), list) and body["data"] and isinstance(_dict(body["data"][0]).get("embedding"), list):
        text = f"embedding of {len(body['data'][0]['embedding'])} numbers"
    else:
        text = orjson.dumps(body).decode()
    # One line of visible text: whitespace runs as one space, other invisible characters
    # (control, format) as U+FFFD, so an answer of only those does not look like none.
    text = "".join(ch if ch.isprintable() else "\ufffd" for ch in " ".join(text.split()))
    if not text:
        return "(empty)"
    return text if len(text) <= EXCERPT_CHARS else text[: EXCERPT_CHARS - 1] + "…"


def result_row(raw: str) -> dict[str, Any]:
    """One output line: custom_id and the answer in short (``_answer``)."""
    record = _record(raw)
    if record is None:
        return {"custom_id": None, "answer": raw[:EXCERPT_CHARS]}
    body = _dict(_dict(record.get("response")).get("body"))
    return {"custom_id": _text(record.get("custom_id")), "answer": _answer(body) if body else raw[:EXCERPT_CHARS]}
