"""``llm-batch validate INPUT... [--endpoint E] [--format F] [--job ID]``: check a batch offline.

Prints one JSON object ``{"total", "valid", "invalid", "errors": [{"line", "custom_id",
"code", "message"}, ...]}``; errors are capped at Settings.max_reported_errors
(LLM_BATCH_MAX_REPORTED_ERRORS, default 100), counts never are. Exit status 0 when at least
one request is valid, 2 otherwise and when the input cannot be read or exceeds a limit
(the reason on stderr).
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import BinaryIO

import orjson

from llm_batch.core.config import get_settings
from llm_batch.core.endpoints import SUPPORTED_ENDPOINTS
from llm_batch.core.input_formats import INPUT_FORMATS
from llm_batch.core.layout import JobLayout
from llm_batch.infra import storage
from llm_batch.infra.storage import StorageError

EXIT_VALID = 0
EXIT_REJECTED = 2  # no valid request, unreadable input, or a limit exceeded

FORMATS = INPUT_FORMATS


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "validate",
        help="check a batch input offline and print counts and errors as JSON",
        description=__doc__.splitlines()[0],
    )
    parser.add_argument(
        "inputs", nargs="+", metavar="INPUT",
        help="a local path, s3:// URI or - (stdin); several inputs are one batch whose "
             "indexes continue from file to file",
    )
    parser.add_argument(
        "--endpoint", default=None,
        help=f"the job's endpoint ({', '.join(SUPPORTED_ENDPOINTS)}); "
             "default: the first line's url, else /v1/chat/completions "
             "(scale-v2: the first item's kind; scale-v1: /v1/completions)",
    )
    parser.add_argument("--format", dest="fmt", choices=FORMATS, default="jsonl",
                        help="input format (default: jsonl)")
    parser.add_argument("--job", metavar="JOB_ID",
                        help="also write the job's validated.jsonl, validation_errors.jsonl and "
                             "validation.json under the work prefix, ready for `llm-batch shard`")
    parser.add_argument("--work-uri", help="work prefix for --job (default: LLM_BATCH_WORK_URI)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from llm_batch.pipeline.validation import BatchRejected, validate_batch  # heavy

    source = args.inputs[0] if len(args.inputs) == 1 else args.inputs
    try:
        layout = _layout(args)
        report = validate_batch(source, fmt=args.fmt, endpoint=args.endpoint,
                                layout=layout, open_input=input_opener(args.fmt))
    except StorageError as exc:  # the job's files (--job)
        print(f"llm-batch validate: cannot write the job's files: {exc}", file=sys.stderr)
        return EXIT_REJECTED
    except BatchRejected as exc:
        if exc.report is not None:  # read through: the counts and errors still help
            sys.stdout.write(orjson.dumps(exc.report.summary()).decode() + "\n")
        print(f"llm-batch validate: rejected ({exc.reason}): {exc}", file=sys.stderr)
        return EXIT_REJECTED
    sys.stdout.write(orjson.dumps(report.summary()).decode() + "\n")
    return EXIT_VALID


def _layout(args: argparse.Namespace):
    """The job to write (--job), refused when it was sharded already: its shards and results
    would no longer match a new validated file."""
    if not args.job:
        return None

    layout = JobLayout(args.work_uri or get_settings().work_uri, args.job)
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
