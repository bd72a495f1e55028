"""``llm-batch shard JOB_ID -n N`` and ``llm-batch merge JOB_ID``: a validated job's steps by
hand: plan its shards (writes the shard files), merge their results into its output files."""

from __future__ import annotations

import argparse
import dataclasses
import json

from llm_batch.cli import fail
from llm_batch.core.config import get_settings
from llm_batch.core.input_formats import InputFormat
from llm_batch.core.layout import JobLayout
from llm_batch.core.scale_output import success_element
from llm_batch.infra.results import ResultsError
from llm_batch.infra.storage import ObjectNotFound, StorageError


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "shard", help="split a validated job into N shard request files and a manifest"
    )
    parser.add_argument("job_id", help="the job whose validated.jsonl to shard")
    parser.add_argument("-n", "--shards", type=int, required=True, help="number of shards, 1..64")
    parser.add_argument("--by", choices=("count", "tokens"), default="count",
                        help="balance by request count (default) or estimated prompt tokens")
    parser.add_argument("--work-uri", help="work prefix (default: LLM_BATCH_WORK_URI)")
    parser.set_defaults(func=shard)

    parser = subparsers.add_parser(
        "merge", help="merge a job's shard results, in input order, into output and error files"
    )
    parser.add_argument("job_id")
    parser.add_argument("--no-jsonl", dest="jsonl", action="store_false",
                        help="skip the OpenAI/Mistral output.jsonl and errors.jsonl")
    parser.add_argument("--scale", action="store_true", help="also write the Scale JSON array")
    parser.add_argument("--scale-v1", action="store_true",
                        help="the job's input was Scale v1 prompts: the array's elements are CompletionOutput "
                             "objects (implies --scale)")
    parser.add_argument("--scale-output", metavar="URI",
                        help="where the Scale array goes (default: the job's output.json)")
    parser.add_argument("--not-run-reason", metavar="TEXT",
                        help="message for requests that never ran (e.g. 'job cancelled')")
    parser.add_argument("--work-uri", help="work prefix (default: LLM_BATCH_WORK_URI)")
    parser.set_defaults(func=merge)


def shard(args: argparse.Namespace) -> int:
    from llm_batch.pipeline.sharding import ShardingError, plan_shards  # heavy

    settings = args.settings or get_settings()
    layout = JobLayout(args.work_uri or settings.work_uri, args.job_id)
    try:
        plans = plan_shards(layout, args.shards, by=args.by, settings=settings)
    except ObjectNotFound as exc:
        hint = (f" (validate the input into the job first: llm-batch validate INPUT --job "
                f"{args.job_id})" if exc.uri == layout.validated else "")
        return fail(f"{exc}{hint}")
    except (ShardingError, StorageError) as exc:
        return fail(str(exc))
    print(json.dumps({
        "manifest": layout.shard_manifest,
        "shards": [p.model_dump(include={"index", "count", "first_index", "last_index", "weight"})
                   for p in plans],
    }))
    return 0


def merge(args: argparse.Namespace) -> int:
    from llm_batch.pipeline.merge import MergeError, merge_job  # heavy

    layout = JobLayout(args.work_uri or get_settings().work_uri, args.job_id)
    try:
        counts = merge_job(layout, jsonl=args.jsonl, json_array=args.scale or args.scale_v1,
                           array_output_uri=args.scale_output, not_run_reason=args.not_run_reason,
                           array_element=success_element(InputFormat.SCALE_V1 if args.scale_v1 else None))
    except ObjectNotFound as exc:
        hint = (f" (plan the job's shards first: llm-batch shard {args.job_id} -n N)"
                if exc.uri == layout.shard_manifest else "")
        return fail(f"{exc}{hint}")
    except (MergeError, ResultsError, StorageError) as exc:
        return fail(str(exc))
    print(json.dumps(dataclasses.asdict(counts)))
    return 0
