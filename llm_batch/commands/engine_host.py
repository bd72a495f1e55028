"""``llm-batch engine-host``: a warm engine (``llm_batch.warm_engines``), started by the local
shard runner when ``LLM_BATCH_WARM_ENGINES`` is on; not meant to be run by hand."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("engine-host", help="a warm engine process (started by the local runner)",
                                   description=__doc__)
    parser.add_argument("--socket", type=Path, required=True, help="the Unix socket to serve shards on")
    parser.add_argument("--lock", type=Path, action="append", required=True,
                        help="a seat's lock file, once per seat (all taken before an idle exit)")
    parser.add_argument("--pid-file", type=Path, required=True, help="where to write this process's pid")
    parser.add_argument("--idle-seconds", type=float, default=300.0, help="exit after this long without a shard")
    parser.set_defaults(func=engine_host)


def engine_host(args: argparse.Namespace) -> int:
    from llm_batch.warm_engines import serve

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return serve(args.socket, args.lock, args.pid_file, args.idle_seconds)
