"""``llm-batch engine-host``: a warm engine (``llm_batch.runtime.warm_engines``).

Two ways to run it:
- on a Unix socket (``--socket``, ``--lock``, ``--pid-file``): started by the local shard
  runner when ``LLM_BATCH_WARM_ENGINES`` is on; not meant to be run by hand;
- on TCP (``--listen HOST:PORT --model NAME``): an engine service, the container command of
  the Deployment ``llm-batch engine-service manifest`` renders (``llm_batch.runtime.engine_service``).
  Its token comes from the environment (``LLM_BATCH_ENGINE_TOKEN``, from a Secret), never
  from the command line, where any process on the node could read it.
"""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path

import orjson

from llm_batch.core import exit_codes
from llm_batch.core.config import parse_address
from llm_batch.runtime.warm_engines import WarmEngineError, serve, serve_service


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("engine-host", help="a warm engine process (local runner, or an engine service)",
                                   description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--socket", type=Path, help="the Unix socket to serve shards on")
    parser.add_argument("--lock", type=Path, action="append",
                        help="a seat's lock file, once per seat (all taken before an idle exit)")
    parser.add_argument("--pid-file", type=Path, help="where to write this process's pid")
    parser.add_argument("--idle-seconds", type=float, default=300.0, help="exit after this long without a shard")
    parser.add_argument("--listen", metavar="HOST:PORT",
                        help="serve as an engine service on this TCP address instead (e.g. 0.0.0.0:8700)")
    parser.add_argument("--model", help="an engine service: the model it serves (a registry name)")
    parser.add_argument("--seats", type=int, default=2, help="an engine service: shards it runs at once")
    parser.add_argument("--preload", nargs="?", const="{}", metavar="JSON",
                        help="an engine service: load the model before listening, with these model_config "
                             "overrides (none: the registry's defaults), so it is ready only when warm")
    parser.set_defaults(func=engine_host)


def engine_host(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.listen is None:
        if args.socket is None or not args.lock or args.pid_file is None:
            logging.error("engine-host: --socket, --lock and --pid-file (local), or --listen and --model (a service)")
            return exit_codes.USAGE
        return serve(args.socket, args.lock, args.pid_file, args.idle_seconds)
    try:
        if not args.model or args.seats < 1:
            raise ValueError("an engine service needs --model and --seats >= 1")
        preload = None if args.preload is None else orjson.loads(args.preload)
        if preload is not None and not isinstance(preload, dict):
            raise ValueError("--preload takes a JSON object of model_config overrides")
        return serve_service(parse_address(args.listen), args.seats, os.environ.get("LLM_BATCH_ENGINE_TOKEN", ""),
                             args.model, preload)
    except (ValueError, WarmEngineError, OSError) as exc:
        logging.error("engine-host: %s", exc)
        return exit_codes.USAGE
