"""``llm-batch estimate``: what a job of a file would take, asked of the server's dry run
(docs/api.md, "Estimates (dry run)"); exit statuses as ``llm-batch validate``'s."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson

from llm_batch.cli import fail
from llm_batch.cli.jobs import _when, _with_client, taken_from_lines
from llm_batch.cli.validate import EXIT_BAD_LINES, EXIT_REJECTED, EXIT_VALID

if TYPE_CHECKING:
    from llm_batch.infra.api_client import BatchClient


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("estimate", description=__doc__.splitlines()[0], help="what a job of this file "
                                   "would take: lines, tokens, engine seconds, start and end (no job made)")
    parser.add_argument("file", type=Path, help="the requests (JSONL)")
    parser.add_argument("--model", help="a registered model name; default: the model every line names (body.model)")
    parser.add_argument("--endpoint", help="e.g. /v1/chat/completions; default: the url the lines name, else that")
    parser.add_argument("--shards", type=int, default=1, help="shards the job would run in parallel (data_parallelism)")
    parser.add_argument("--json", action="store_true", help="print the server's estimate as one JSON object")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if not args.file.is_file():
        return fail(f"{args.file}: no such file")
    model, endpoint, problem = taken_from_lines(args.file, args.model, args.endpoint)
    if problem:
        return fail(problem)

    def estimate(client: BatchClient) -> int:
        answer = client.estimate(args.file, model=model, endpoint=endpoint, shards=args.shards)
        sys.stdout.write(orjson.dumps(answer).decode() + "\n" if args.json else readable(answer))
        if answer.get("would_fail"):
            return EXIT_REJECTED
        return EXIT_BAD_LINES if answer["invalid"] else EXIT_VALID

    return _with_client(estimate, args)


def _figure(value: Any, unit: str = "") -> str:
    if value is None:
        return "unknown"
    return f"{value:,}{unit}" if isinstance(value, int) else f"{value:,.1f}{unit}"


def readable(est: dict[str, Any]) -> str:
    """The estimate for a person: counts, the first bad lines, the figures, then why any is unknown."""
    lines = [f"{est['total']} lines read: {est['valid']} valid, {est['invalid']} bad ({est['model']}, {est['endpoint']})"]
    lines += [f"  line {e['line']}  {e['code']}: {e['message']}" for e in est["errors"]]
    if est["invalid"] > len(est["errors"]):
        lines.append(f"  ... and {est['invalid'] - len(est['errors'])} more (llm-batch validate lists them)")
    if est.get("would_fail"):
        lines.append(f"the job would fail: {est['would_fail']}")
    about = "" if est["prompt_tokens_exact"] or est["prompt_tokens"] is None else " (about)"
    rate = est["tokens_per_s"]
    lines += [
        f"prompt tokens      {_figure(est['prompt_tokens'])}{about}",
        f"most output tokens {_figure(est['max_output_tokens'])}",
        f"tokens/s           {_figure(rate)}" + (f" (measured over {est['rate_jobs']} ended jobs)" if rate else ""),
        f"engine seconds     {_figure(est['engine_seconds'], ' s')}" + (" (at most)" if est["engine_seconds"] else ""),
        f"start and merge    {_figure(est.get('overhead_seconds'), ' s')}"
        + (" (recent jobs' median beyond their engine time)" if est.get("overhead_seconds") is not None else ""),
        f"jobs ahead         {est['jobs_ahead']}" + (f" ({est['jobs_ahead_unknown']} without an estimate)"
                                                    if est["jobs_ahead_unknown"] else ""),
        f"expected start     {_when(est['expected_start'])}",
        f"expected end       {_when(est['expected_end'])}",
    ]
    lines += [f"note: {note}" for note in est["notes"]]
    return "\n".join(lines) + "\n"
