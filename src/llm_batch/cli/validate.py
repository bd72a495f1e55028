"""``llm-batch validate``: check a batch offline (its output and exit statuses: docs/validation.md)."""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from collections import Counter
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import BinaryIO

import orjson

from llm_batch.core.config import Settings, get_settings
from llm_batch.core.endpoints import SUPPORTED_ENDPOINTS
from llm_batch.core.input_formats import INPUT_FORMATS
from llm_batch.core.layout import JobLayout
from llm_batch.infra import storage
from llm_batch.infra.storage import StorageError

EXIT_VALID = 0  # every line is valid
EXIT_BAD_LINES = 1  # some lines are bad: a job would run the others
EXIT_REJECTED = 2  # no valid request, unreadable input, or a limit exceeded
# Bad lines the readable summary shows (--json shows up to max_reported_errors).
SHOWN_ERRORS = 10


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "validate", description=__doc__.splitlines()[0],
        help="check a batch input offline: counts and bad lines (exit 0 all valid, 1 some bad, 2 refused)")
    parser.add_argument("inputs", nargs="+", metavar="INPUT",
                        help="a local path, s3:// URI or - (stdin); several inputs are one batch whose "
                             "indexes continue from file to file")
    parser.add_argument("--endpoint", default=None,
                        help=f"the job's endpoint ({', '.join(SUPPORTED_ENDPOINTS)}); default: the first line's "
                             "url, else /v1/chat/completions (scale-v2: the first item's kind; scale-v1: "
                             "/v1/completions)")
    parser.add_argument("--format", dest="fmt", choices=INPUT_FORMATS, default="jsonl",
                        help="input format (default: jsonl)")
    parser.add_argument("--job", metavar="JOB_ID",
                        help="also write the job's validated.jsonl, validation_errors.jsonl and "
                             "validation.json under the work prefix, ready for `llm-batch shard`")
    parser.add_argument("--work-uri", help="work prefix for --job (default: LLM_BATCH_WORK_URI)")
    parser.add_argument("--json", action="store_true", help="print the counts and errors as one JSON object")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from llm_batch.pipeline.validation import BatchRejected, ValidationLimits, validate_batch  # heavy

    settings = args.settings or get_settings()
    source = args.inputs[0] if len(args.inputs) == 1 else args.inputs
    try:
        layout = _layout(args, settings)
        report = validate_batch(source, fmt=args.fmt, endpoint=args.endpoint, layout=layout,
                                limits=ValidationLimits.from_settings(settings), open_input=input_opener(args.fmt))
    except StorageError as exc:  # the job's files (--job)
        print(f"llm-batch validate: cannot write the job's files: {exc}", file=sys.stderr)
        return EXIT_REJECTED
    except BatchRejected as exc:
        if exc.report is not None:  # read through: the counts and errors still help
            _print(exc.report.summary(), args.json)
        print(f"llm-batch validate: rejected ({exc.reason}): {exc}", file=sys.stderr)
        return EXIT_REJECTED
    summary = report.summary()
    _print(summary, args.json)
    return EXIT_BAD_LINES if summary["invalid"] else EXIT_VALID


def _print(summary: dict, as_json: bool) -> None:
    sys.stdout.write(orjson.dumps(summary).decode() + "\n" if as_json else readable(summary))


def readable(summary: dict) -> str:
    """The summary for a person: counts, bad lines by code, the first bad lines."""
    total, valid, invalid = summary["total"], summary["valid"], summary["invalid"]
    lines = [f"{total} line{'s' if total != 1 else ''} read: {valid} valid, {invalid} bad"]
    errors = summary["errors"]
    if errors:
        by_code = Counter(e["code"] for e in errors)
        counted = ", ".join(f"{code} {n}" for code, n in by_code.most_common())
        more = " (of the first reported)" if len(errors) < invalid else ""
        lines.append(f"bad lines by code{more}: {counted}")
        for e in errors[:SHOWN_ERRORS]:
            custom_id = f"custom_id={e['custom_id']}" if e["custom_id"] is not None else "custom_id=-"
            lines.append(f"  line {e['line']}  {custom_id}  {e['code']}: {e['message']}")
        if invalid > SHOWN_ERRORS:
            lines.append(f"  ... and {invalid - SHOWN_ERRORS} more (all of them: --json)")
    return "\n".join(lines) + "\n"


def _layout(args: argparse.Namespace, settings: Settings):
    """The job to write (--job), refused when it was sharded already: its shards and results
    would no longer match a new validated file."""
    if not args.job:
        return None

    layout = JobLayout(args.work_uri or settings.work_uri, args.job)
    if storage.exists(layout.shard_manifest):
        raise storage.StorageError(layout.root, f"job {args.job!r} has shards already; validate "
                                   "into a new job id (or delete this one's directory)")
    return layout


def input_opener(fmt: str) -> Callable[[str], AbstractContextManager[BinaryIO]]:
    """How the CLI opens an input: s3:// through storage; local paths and stdin (``-``)
    directly. The CLI reads the user's own files with the user's own rights, so storage's
    root confinement (meant for paths that API users send) does not apply here.

    scale-v1 reads its input twice (its shared fields may follow the prompts), so stdin is
    then replayed: from a temporary copy when it is a pipe."""
    stdin: BinaryIO | None = None

    def open_input(uri: str) -> AbstractContextManager[BinaryIO]:
        nonlocal stdin
        if uri == "-":
            if stdin is None:
                stdin = _replayable(sys.stdin.buffer) if fmt == "scale-v1" else sys.stdin.buffer
            if fmt == "scale-v1":
                stdin.seek(0)
            return nullcontext(stdin)
        if uri.startswith("s3://"):
            return storage.open_read(uri)
        return open(uri, "rb")

    return open_input


def _replayable(stream: BinaryIO) -> BinaryIO:
    copy = tempfile.TemporaryFile()  # deleted when closed, at exit at the latest
    shutil.copyfileobj(stream, copy)
    return copy
