"""``llm-batch retry | rerun``: a new job made from an ended one, through the batch REST API.
Prints the new job's id on stdout (what a script keeps); exit codes as ``submit``'s, 2 when
the API refuses (the job still runs, nothing failed, its input is gone)."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from llm_batch.cli.jobs import EXIT_SUCCEEDED, _client_command, _wait_and_report

if TYPE_CHECKING:
    from llm_batch.infra.api_client import BatchClient

_HELP = {
    "retry": "a new job of an ended job's failed and never-run lines (lines refused at validation are left out)",
    "rerun": "a new job of an ended job's whole input, with the same model and options",
}


def register(subparsers: argparse._SubParsersAction) -> None:
    for kind, help_text in _HELP.items():
        parser = subparsers.add_parser(kind, help=help_text, description=help_text[0].upper() + help_text[1:] + ".")
        parser.add_argument("job_id", metavar="JOB", help="the ended job's id")
        parser.add_argument("--wait", action="store_true",
                            help="show progress and wait for the new job's end (exit code = outcome)")
        parser.add_argument("--idempotency-key", metavar="KEY",
                            help="send this Idempotency-Key: the same key makes one new job however often it is sent")
        parser.set_defaults(func=_derive, kind=kind)


@_client_command
def _derive(client: BatchClient, args: argparse.Namespace) -> int:
    from llm_batch.infra.api_client import JobView  # heavy

    send = client.retry_job if args.kind == "retry" else client.rerun_job
    job = JobView.of(send(args.job_id, idempotency_key=args.idempotency_key))
    print(job.id)
    print(f"{args.kind} of {args.job_id}: {job.id} ({job.status}); follow it with: llm-batch job {job.id} --wait",
          file=sys.stderr)
    return _wait_and_report(client, job) if args.wait else EXIT_SUCCEEDED
