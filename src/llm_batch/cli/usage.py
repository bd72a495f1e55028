"""``llm-batch usage``: ``GET /v1/usage`` as a table. Exit codes: 0, or 2 for a usage or HTTP error."""

from __future__ import annotations

import argparse
import re
import sys
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

import orjson

from llm_batch.cli import print_table
from llm_batch.cli.jobs import EXIT_SUCCEEDED, _client_command

if TYPE_CHECKING:
    from llm_batch.infra.api_client import BatchClient

_UNITS = {"s": "seconds", "m": "minutes", "h": "hours", "d": "days", "w": "weeks"}
_RELATIVE = re.compile(r"(\d+)([smhdw])")


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "usage", help="tokens, requests, engine and GPU seconds summed over your jobs (admins: everyone's)",
        description="Tokens, requests, engine and GPU seconds summed over jobs (any status; live jobs with their "
        "live counts), through the batch REST API (GET /v1/usage): your own jobs; an admin API key sees every "
        "owner's. GPU seconds: each job's engine seconds x its GPUs (1 when the job names none, 0 for a job "
        "recorded with 0 GPUs).")
    parser.add_argument("--by", choices=("owner", "model", "label"),
                        help="group by owner, model or label (one group per key=value: a job with two labels "
                        "counts in both, jobs without labels in '(none)'); default: one group '(all)'")
    parser.add_argument("--since", type=parse_since, metavar="WHEN",
                        help="only jobs created at or after WHEN: an age (30m, 12h, 7d, 2w), a date (2026-11-01, "
                        "UTC) or an ISO 8601 time (no zone: UTC); default: every job")
    parser.add_argument("--json", action="store_true", help="print the API's JSON answer instead of a table")
    parser.set_defaults(func=_usage_command)


def parse_since(text: str, now: datetime | None = None) -> datetime:
    """An age back from `now` (``7d``: s, m, h, d, w), else an ISO 8601 date or time (no
    zone: UTC) -> an aware UTC datetime; ArgumentTypeError (argparse's usage error) otherwise."""
    value = text.strip()
    if match := _RELATIVE.fullmatch(value):
        return (now or datetime.now(UTC)) - timedelta(**{_UNITS[match[2]]: int(match[1])})
    try:
        when = datetime.fromisoformat(value)
        return (when.replace(tzinfo=UTC) if when.tzinfo is None else when).astimezone(UTC)
    except (ValueError, OverflowError):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not an age (7d, 12h, 30m, 2w) or an ISO 8601 date or time (2026-11-01, 2026-11-01T08:00Z)"
        ) from None


@_client_command
def _usage_command(client: BatchClient, args: argparse.Namespace) -> int:
    report = client.usage(by=args.by, since=args.since)
    if args.json:
        sys.stdout.write(orjson.dumps(report, option=orjson.OPT_INDENT_2).decode() + "\n")
    else:
        print_report(report)
    return EXIT_SUCCEEDED


# CACHED TOK: prompt tokens the engine's prefix cache served; FROM CACHE: requests the result
# cache answered; RETRIES: answers tried again for failing the job's output check.
_COLUMNS = ("JOBS", "REQUESTS", "SUCCEEDED", "FAILED", "PROMPT TOK", "COMPLETION TOK", "CACHED TOK",
            "FROM CACHE", "RETRIES", "ENGINE S", "GPU S")


def print_report(report: dict[str, Any]) -> None:
    """The report as a table, one row per group (an empty report says so on stderr)."""
    by, since = report.get("by"), report.get("since")
    scope = f"jobs created since {since}" if since else "all jobs"
    print(f"usage{f' by {by}' if by else ''} of {scope}", file=sys.stderr)
    groups = report.get("data") or []
    if not groups:
        print("no jobs match", file=sys.stderr)
        return
    rows = [((by or "group").upper(), *_COLUMNS)]
    for group in groups:
        requests = group["requests"]
        rows.append((
            group["group"], f"{group['jobs']:,}", f"{requests['total']:,}", f"{requests['succeeded']:,}",
            f"{requests['failed']:,}", f"{group['prompt_tokens']:,}", f"{group['completion_tokens']:,}",
            f"{group['cached_prompt_tokens']:,}", f"{group.get('cached_requests', 0):,}",
            f"{group.get('output_retries', 0):,}", f"{group['engine_seconds']:,.1f}", f"{group['gpu_seconds']:,.1f}",
        ))
    print_table(rows)
