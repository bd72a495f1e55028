"""``llm-batch shard JOB_ID -n N``: plan a validated job's shards (writes the shard files)."""

from __future__ import annotations

import argparse
import json
import sys

from llm_batch.core.config import get_settings
from llm_batch.core.layout import JobLayout
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


def shard(args: argparse.Namespace) -> int:
    from llm_batch.pipeline.sharding import ShardingError, plan_shards  # heavy

    settings = args.settings or get_settings()
    layout = JobLayout(args.work_uri or settings.work_uri, args.job_id)
    try:
        plans = plan_shards(layout, args.shards, by=args.by, settings=settings)
    except ObjectNotFound as exc:
        hint = (f" (validate the input into the job first: llm-batch validate INPUT --job "
                f"{args.job_id})" if exc.uri == layout.validated else "")
        print(f"error: {exc}{hint}", file=sys.stderr)
        return 2
    except (ShardingError, StorageError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps({
        "manifest": layout.shard_manifest,
        "shards": [p.model_dump(include={"index", "count", "first_index", "last_index", "weight"})
                   for p in plans],
    }))
    return 0
