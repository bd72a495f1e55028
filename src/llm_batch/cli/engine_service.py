"""``llm-batch engine-host`` and ``llm-batch engine-service``: warm engines, on this machine or on Kubernetes."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

import orjson

from llm_batch.core import exit_codes
from llm_batch.core.config import get_settings, parse_address
from llm_batch.core.placement import GPU_TYPES
from llm_batch.runtime.warm_engines import DEFAULT_PORT, WarmEngineError, serve, serve_service

MANIFEST_DOC = """``llm-batch engine-service manifest``: the Kubernetes objects of an engine service (a warm
engine Deployment for one model and GPU type, its Service and NetworkPolicy) as YAML, to
apply with ``kubectl apply -f -``; the settings line that routes the model's small shards to
it goes to stderr. See docs/orchestration.md, "Engine services"."""
HOST_DOC = """``llm-batch engine-host``: a warm engine (``llm_batch.runtime.warm_engines``).

On a Unix socket (``--socket``, ``--lock``, ``--pid-file``) the local shard runner starts it
(``LLM_BATCH_WARM_ENGINES``); on TCP (``--listen HOST:PORT --model NAME``) it is an engine
service, the container of the Deployment ``llm-batch engine-service manifest`` renders, its
token from the environment (``LLM_BATCH_ENGINE_TOKEN``), never the command line, which any
process on the node can read.
"""


def register(subparsers: argparse._SubParsersAction) -> None:
    host = subparsers.add_parser("engine-host", help="a warm engine process (local runner, or an engine service)",
                                 description=HOST_DOC, formatter_class=argparse.RawDescriptionHelpFormatter)
    host.add_argument("--socket", type=Path, help="the Unix socket to serve shards on")
    host.add_argument("--lock", type=Path, action="append",
                      help="a seat's lock file, once per seat (all taken before an idle exit)")
    host.add_argument("--pid-file", type=Path, help="where to write this process's pid")
    host.add_argument("--idle-seconds", type=float, default=300.0, help="exit after this long without a shard")
    host.add_argument("--listen", metavar="HOST:PORT",
                      help="serve as an engine service on this TCP address instead (e.g. 0.0.0.0:8700)")
    host.add_argument("--model", help="an engine service: the model it serves (a registry name)")
    host.add_argument("--seats", type=int, default=2, help="an engine service: shards it runs at once")
    host.add_argument("--preload", nargs="?", const="{}", metavar="JSON",
                      help="an engine service: load the model before listening, with these model_config "
                           "overrides (none: the registry's defaults), so it is ready only when warm; "
                           "a local host: the model_config to load once listening (a job's prepare starts it so)")
    host.add_argument("--preload-lora", action="store_true",
                      help="a local host: preload with LoRA on, as the shards of an adapter's job load it")
    host.set_defaults(func=engine_host)

    parser = subparsers.add_parser("engine-service", help="warm engines on Kubernetes (manifests)",
                                   description=MANIFEST_DOC)
    actions = parser.add_subparsers(dest="action", required=True)
    manifest = actions.add_parser("manifest", help="print the Deployment, Service and NetworkPolicy")
    manifest.add_argument("--model", required=True, help="the model it serves (a registry name)")
    manifest.add_argument("--gpu-type", help="the GPU type its pods run on (one of the runner's gpu_type values)")
    manifest.add_argument("--gpus", type=int, default=1, help="GPUs per pod")
    manifest.add_argument("--replicas", type=int, default=1, help="pods (engines)")
    manifest.add_argument("--seats", type=int, default=2, help="shards each engine runs at once")
    manifest.add_argument("--port", type=int, default=None, help="its TCP port (default 8700)")
    manifest.add_argument("--token-secret", default="llm-batch-engine-token",
                          help="the Secret holding the token (key 'token'), shared with the Airflow workers")
    manifest.add_argument("--client-label", action="append", default=[], metavar="KEY=VALUE",
                          help="a label of the pods let in (Airflow's workers; default component=worker, "
                               "tier=airflow); repeat for more")
    manifest.add_argument("--preload-config", default="{}", metavar="JSON",
                          help="model_config overrides the engine loads at start (default {}: the registry's "
                               "defaults, what a job without model_config asks for)")
    manifest.add_argument("--no-preload", action="store_true",
                          help="load the engine with the first shard instead (the pod is ready before it is warm)")
    manifest.set_defaults(func=print_manifest)


def print_manifest(args: argparse.Namespace) -> int:
    import yaml  # heavy

    problems = []
    if args.gpu_type is not None and args.gpu_type not in GPU_TYPES:
        problems.append(f"--gpu-type {args.gpu_type!r} is unknown; use one of {', '.join(GPU_TYPES)}")
    for flag in ("gpus", "replicas", "seats"):
        if getattr(args, flag) < 1:
            problems.append(f"--{flag} must be at least 1")
    port = args.port or DEFAULT_PORT
    if not 0 < port < 65536:
        problems.append(f"--port {port} is not a TCP port")
    try:
        _json_object(args.preload_config)
    except ValueError:
        problems.append("--preload-config takes a JSON object of model_config overrides")
    labels = dict(label.partition("=")[::2] for label in args.client_label)
    if any(not key or not value for key, value in labels.items()):
        problems.append("--client-label takes KEY=VALUE")
    if problems:
        print("llm-batch engine-service: " + "; ".join(problems), file=sys.stderr)
        return exit_codes.USAGE

    from llm_batch.airflow.specs.engine_service_spec import manifests, services_entry  # kubernetes

    settings = get_settings()
    objects = manifests(settings, args.model, args.gpu_type, gpus=args.gpus, replicas=args.replicas,
                        seats=args.seats, port=port, token_secret=args.token_secret, client_labels=labels or None,
                        preload=None if args.no_preload else args.preload_config)
    sys.stdout.write(yaml.safe_dump_all(objects, sort_keys=False))
    entry = orjson.dumps(services_entry(settings, args.model, args.gpu_type, port)).decode()
    print(f"# route the model's small shards here (Airflow workers): LLM_BATCH_ENGINE_SERVICES='{entry}'",
          file=sys.stderr)
    return 0


def engine_host(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        preload = None if args.preload is None else _json_object(args.preload)
    except ValueError as exc:
        logging.error("engine-host: %s", exc)
        return exit_codes.USAGE
    if args.listen is None:
        if args.socket is None or not args.lock or args.pid_file is None:
            logging.error("engine-host: --socket, --lock and --pid-file (local), or --listen and --model (a service)")
            return exit_codes.USAGE
        return serve(args.socket, args.lock, args.pid_file, args.idle_seconds, preload, args.preload_lora)
    try:
        if not args.model or args.seats < 1:
            raise ValueError("an engine service needs --model and --seats >= 1")
        return serve_service(parse_address(args.listen), args.seats, os.environ.get("LLM_BATCH_ENGINE_TOKEN", ""),
                             args.model, preload)
    except (ValueError, WarmEngineError, OSError) as exc:
        logging.error("engine-host: %s", exc)
        return exit_codes.USAGE


def _json_object(text: str) -> dict:
    """``--preload``'s value (ValueError: not a JSON object)."""
    value = orjson.loads(text)  # orjson.JSONDecodeError is a ValueError
    if not isinstance(value, dict):
        raise ValueError("--preload takes a JSON object of model_config keys")
    return value
