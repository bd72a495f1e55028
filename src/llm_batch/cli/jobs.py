"""``llm-batch submit | jobs | job | cancel | results``: jobs through the native REST route.

Exit codes (``--wait`` reports the job's end): 0 succeeded (or done), 1 failed, 2 usage or
HTTP error, 3 cancelled, 4 timed out.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

import orjson

from llm_batch.cli import fail, print_table
from llm_batch.core.endpoints import Endpoint
from llm_batch.core.job_spec import JobSpec, field_schemas
from llm_batch.core.jobs import JobStatus

if TYPE_CHECKING:
    from llm_batch.infra.api_client import BatchClient, JobView

EXIT_SUCCEEDED = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_CANCELLED = 3
EXIT_TIMED_OUT = 4

EXIT_OF_STATUS = {
    JobStatus.SUCCEEDED: EXIT_SUCCEEDED,
    JobStatus.FAILED: EXIT_FAILED,
    JobStatus.CANCELLED: EXIT_CANCELLED,
    JobStatus.TIMEOUT_EXCEEDED: EXIT_TIMED_OUT,
}


def register(subparsers: argparse._SubParsersAction) -> None:
    submit = subparsers.add_parser("submit", help="submit a batch file through the REST API")
    submit.add_argument("file", type=Path, help="the requests (JSONL, or a Scale JSON file with --format); "
                        "uploaded streamed, so any size up to the server's upload limit")
    submit.add_argument("--endpoint", help="e.g. /v1/chat/completions; default: the url the file's lines "
                        "name, when they all name the same one, else /v1/chat/completions")
    submit.add_argument("--model", help="a registered model name (llm-batch models list); default: the model "
                        "the file's lines name (body.model), when they all name the same one")
    _add_spec_flags(submit)
    submit.add_argument("--wait", action="store_true", help="show progress and wait for the end (exit code = outcome)")
    again = submit.add_mutually_exclusive_group()
    again.add_argument(
        "--idempotency-key", metavar="KEY",
        help="the Idempotency-Key to send (up to 255 printable ASCII characters). By default submit sends a key "
        "derived from the file's sha256 and these arguments, so re-running the same command (a retry after a "
        "timeout, a script run twice) answers the job it made before instead of submitting it again (the "
        "server keeps keys 24 hours)",
    )
    again.add_argument("--new", action="store_true", help="send no Idempotency-Key: always submit a new job")
    submit.set_defaults(func=_submit)

    listing = subparsers.add_parser("jobs", help="list your newest jobs")
    listing.add_argument("--limit", type=int, default=20)
    listing.add_argument("--search", metavar="TEXT",
                         help="only jobs whose id starts with TEXT, or whose input file name or path, or a label's "
                         "key or value, contains it (any case, taken literally)")
    listing.set_defaults(func=_jobs)

    show = subparsers.add_parser("job", help="show one job")
    show.add_argument("job_id")
    show.add_argument("--wait", action="store_true", help="show progress and wait for the end (exit code = outcome)")
    show.set_defaults(func=_job)

    cancel = subparsers.add_parser("cancel", help="cancel a job (finished results are kept)")
    cancel.add_argument("job_id")
    cancel.set_defaults(func=_cancel)

    results = subparsers.add_parser("results", help="download a job's results (JSONL, input order)")
    results.add_argument("job_id")
    results.add_argument("--errors", action="store_true", help="the error file instead (failed and invalid requests)")
    results.add_argument("-o", "--output", type=Path, help="write to this file instead of stdout")
    results.add_argument("--partial", action="store_true",
                         help="the finished lines so far, also while the job runs (NDJSON: index, line, "
                         "custom_id and the line's output or error; see docs/api.md)")
    results.add_argument("--order", choices=("input", "finished"), default="input",
                         help="with --partial: input order up to the first unfinished line (default), "
                         "or every finished line")
    results.set_defaults(func=_results)


# -- commands ---------------------------------------------------------------------------------


# A spec field's flag is --field-name unless named here.
_FLAG_NAMES = {"data_parallelism": ("--shards", "--data-parallelism"), "input_format": ("--format",),
               "max_runtime_sec": ("--max-runtime", "--max-runtime-sec"), "output_uri": ("--output",),
               "labels": ("--label",)}
# The spec fields BatchClient.submit names itself (its argument); it sends the others as given.
_CLIENT_ARGS = {"data_parallelism": "shards", "input_format": "input_format", "max_runtime_sec": "max_runtime_sec",
                "output_uri": "output_path", "labels": "metadata", "model_config": "model_config",
                "output_check": "output_check", "result_cache": "result_cache", "priority": "priority"}


SPEC_KEYS = [field.alias or name for name, field in JobSpec.model_fields.items()]


def _add_spec_flags(parser: argparse.ArgumentParser) -> None:
    """A flag for every field of the job's spec but model and endpoint, typed by its JSON schema."""
    schemas = field_schemas(JobSpec)
    for key in SPEC_KEYS:
        if key in ("model", "endpoint"):
            continue
        schema = schemas[key]
        types = set(schema["type"]) - {"null"}
        flags = _FLAG_NAMES.get(key, ("--" + key.replace("_", "-"),))
        more: dict[str, Any] = {"dest": key, "help": schema.get("description")}
        if types == {"boolean"}:
            more["action"] = argparse.BooleanOptionalAction
        elif schema.get("additionalProperties") == {"type": "string"}:  # pairs: KEY=VALUE, repeated
            more.update(action="append", type=_label, metavar="KEY=VALUE")
        elif types == {"object"}:
            more.update(type=_json_object, metavar="JSON")
        elif types == {"integer"}:
            more["type"] = int
        elif types == {"string", "integer"}:
            more["type"] = lambda text: int(text) if text.isdigit() else text
        if "enum" in schema:
            more["choices"] = [choice for choice in schema["enum"] if choice is not None]
        parser.add_argument(*flags, **more)


def _submit(args: argparse.Namespace) -> int:
    if not args.file.is_file():
        return fail(f"{args.file}: no such file")

    spec = {key: value for key in SPEC_KEYS if (value := getattr(args, key, None)) is not None}
    spec["labels"] = dict(spec.get("labels") or ()) or None
    named = {_CLIENT_ARGS[name]: spec.pop(name) for name in list(spec) if name in _CLIENT_ARGS}
    input_format = named.get("input_format", "jsonl")
    if input_format != "jsonl":
        if args.model is None:
            return fail(f"--model is required for a {input_format} file")
        model, endpoint = args.model, args.endpoint or Endpoint.CHAT_COMPLETIONS.value
    else:
        model, endpoint, problem = taken_from_lines(args.file, args.model, args.endpoint)
        if problem:
            return fail(problem)

    def run(client: BatchClient) -> int:
        job = client.submit(args.file, endpoint=endpoint, model=model, idempotency_key=args.idempotency_key,
                            new=args.new, spec=spec or None, **{k: v for k, v in named.items() if v is not None})
        print(job.id)
        if job.replayed:
            print(f"already submitted: {job.id} ({job.status}), the job of an earlier submit of the same file and "
                  f"options (--new submits another); follow it with: llm-batch job {job.id} --wait", file=sys.stderr)
        else:
            print(f"submitted {job.id} ({job.status}); follow it with: llm-batch job {job.id} --wait", file=sys.stderr)
        return _wait_and_report(client, job) if args.wait else EXIT_SUCCEEDED

    return _with_client(run, args)


# What a JSONL line names, where: its model in its body, its endpoint as its url.
_NAMED_AT = {"model": ("body", "model"), "url": ("url",)}


def named_by_lines(path: Path, what: str) -> tuple[str | None, str | None]:
    """(the one ``what`` ("model" or "url") the JSONL lines name, None), or (None, why not)
    when they name several; lines that do not parse are left to validation."""
    first_line_of: dict[str, int] = {}
    with path.open("rb") as lines:
        for number, line in enumerate(lines, start=1):
            try:
                named: Any = orjson.loads(line)
            except orjson.JSONDecodeError:
                continue
            for key in _NAMED_AT[what]:
                named = named.get(key) if isinstance(named, dict) else None
            if isinstance(named, str) and named and named not in first_line_of:
                first_line_of[named] = number
    if len(first_line_of) <= 1:
        return next(iter(first_line_of), None), None
    named = ", ".join(f"{m!r} (line {n})" for m, n in list(first_line_of.items())[:5])
    return None, f"{path}: the lines name {len(first_line_of)} {what}s: {named}"


def taken_from_lines(path: Path, model: str | None, endpoint: str | None) -> tuple[str, str, str | None]:
    """(model, endpoint, None): those given, else what the lines name; or ("", "", why not)."""
    if model is None:
        model, problem = named_by_lines(path, "model")
        if problem or model is None:
            return "", "", f"{problem or f'{path}: no line names a model (body.model)'}: give --model"
    if endpoint is None:
        endpoint, problem = named_by_lines(path, "url")
        if problem:
            return "", "", f"{problem}: give --endpoint"
    return model, endpoint or Endpoint.CHAT_COMPLETIONS.value, None


def _label(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"{text!r}: give KEY=VALUE")
    return key, value


def _client_command(action: Callable[[BatchClient, argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """``action(client, args)`` as a command, run with the batch API's client."""
    return lambda args: _with_client(lambda client: action(client, args), args)


@_client_command
def _jobs(client: BatchClient, args: argparse.Namespace) -> int:
    rows = [("ID", "STATUS", "MODEL", "DONE/TOTAL", "FAILED", "CREATED")]
    for job in client.jobs(limit=args.limit, search=args.search):
        rows.append((job.id, job.shown_status, job.model or "-", f"{job.completed}/{job.total}",
                     str(job.failed), _when(job.created_at)))
    print_table(rows)
    return EXIT_SUCCEEDED


@_client_command
def _job(client: BatchClient, args: argparse.Namespace) -> int:
    job = client.job(args.job_id)
    if args.wait and not job.terminal:
        return _wait_and_report(client, job)
    _describe(job)
    return EXIT_OF_STATUS.get(job.status, EXIT_SUCCEEDED) if args.wait else EXIT_SUCCEEDED


@_client_command
def _cancel(client: BatchClient, args: argparse.Namespace) -> int:
    job = client.cancel(args.job_id)
    print(f"{job.id}: {job.status}")
    return EXIT_SUCCEEDED


def _results(args: argparse.Namespace) -> int:
    if args.partial:
        return _partial_results(args)
    if args.order != "input":
        return fail("--order goes with --partial")

    def run(client: BatchClient) -> int:
        job = client.job(args.job_id)
        file_id = job.error_file if args.errors else job.output_file
        if file_id is None:
            kind = "error" if args.errors else "output"
            why = "it has none (no request failed)" if job.terminal else f"it is {job.status}; wait for it to end"
            return fail(f"job {job.id} has no {kind} file: {why}")
        with _output(args) as out:
            for chunk in client.file_content(file_id):
                out.write(chunk)
        return EXIT_SUCCEEDED

    return _with_client(run, args)


def _partial_results(args: argparse.Namespace) -> int:
    if args.errors:
        return fail("--errors and --partial do not go together: a partial read has both kinds of line")

    def run(client: BatchClient) -> int:
        shown = 0
        with _output(args) as out, client.partial_results(args.job_id, order=args.order) as read:
            for line in read.lines:
                out.write(line + b"\n")
                shown += 1
        state = "complete: the job has ended" if read.complete else "incomplete: the job has not ended"
        print(f"{args.job_id}: {read.status}, {shown} finished lines ({state})", file=sys.stderr)
        return EXIT_SUCCEEDED

    return _with_client(run, args)


# -- helpers ----------------------------------------------------------------------------------


def _output(args: argparse.Namespace) -> AbstractContextManager[BinaryIO]:
    """``--output`` opened, else stdout (left open)."""
    return args.output.open("wb") if args.output else nullcontext(sys.stdout.buffer)


def _json_object(text: str) -> dict:
    try:
        value = orjson.loads(text)
    except orjson.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


def _with_client(run, args: argparse.Namespace) -> int:
    """Run `run(client)`; API, network and input errors become a message and exit 2."""
    import httpx  # heavy

    from llm_batch.infra.api_client import ApiError, BatchClient, NoApiKey  # heavy

    given = {name: value for name in ("settings", "environ") if (value := getattr(args, name, None)) is not None}
    try:
        with BatchClient.from_env(**given) as client:
            return run(client)
    except (ApiError, NoApiKey, ValueError, OSError) as exc:
        return fail(str(exc))
    except httpx.HTTPError as exc:
        return fail(f"the batch API did not answer ({exc}); is the stack up? (llm-batch status)")


def _wait_and_report(client: BatchClient, job: JobView) -> int:
    job = _follow(client, job)
    _describe(job)
    return EXIT_OF_STATUS.get(job.status, EXIT_FAILED)


def _follow(client: BatchClient, job: JobView) -> JobView:
    """Poll the job with a progress bar (requests done/total, tokens/s) until it ends."""
    from rich.console import Console  # heavy
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn  # heavy

    columns = (
        TextColumn("[bold]{task.fields[status]:<16}"), BarColumn(), MofNCompleteColumn(),
        TextColumn("requests  {task.fields[rate]}"), TimeElapsedColumn(),
    )
    with Progress(*columns, console=Console(stderr=True), transient=False) as progress:
        bar = progress.add_task("job", total=None, status=job.shown_status, rate="")

        def update(current: JobView) -> None:
            progress.update(
                bar, completed=current.completed, total=current.total or None, status=current.shown_status,
                rate=f"{current.tokens_per_s:,.0f} tokens/s" if current.tokens_per_s else "",
            )

        return client.wait(job.id, poll=1.0, on_update=update)


def _describe(job: JobView) -> None:
    print(f"job        {job.id}")
    print(f"status     {job.status}")
    if job.queue_position:
        print(f"queue      #{job.queue_position}: waits for {job.waiting_for}")
    print(f"model      {job.model or '-'}  ({job.endpoint})")
    print(f"requests   {job.completed}/{job.total} done: {job.succeeded} succeeded, {job.failed} failed")
    print(f"created    {_when(job.created_at)}")
    if job.started_at:
        print(f"started    {_when(job.started_at)}")
    if job.ended_at:
        print(f"ended      {_when(job.ended_at)}")
    if job.output_file:
        print(f"results    {job.output_file}   (llm-batch results {job.id})")
    if job.error_file and job.failed:
        print(f"errors     {job.error_file}   (llm-batch results {job.id} --errors)")
    for message in job.errors:
        print(f"note       {message}")


def _when(epoch: int | None) -> str:
    if not epoch:
        return "-"
    return datetime.fromtimestamp(epoch, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")

