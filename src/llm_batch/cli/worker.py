"""``llm-batch worker``: run one shard on vLLM's offline engine (the inference image entrypoint).

Every flag falls back to an ``LLM_BATCH_WORKER_<FLAG>`` environment variable (e.g.
``--model-config`` <- ``LLM_BATCH_WORKER_MODEL_CONFIG``), so a pod spec can pass either.
The exit status is one of ``llm_batch.core.exit_codes``. The flags: ``llm_batch.runtime.worker_args``.
"""

from __future__ import annotations

import argparse
import logging

import orjson

from llm_batch.core import exit_codes
from llm_batch.core.endpoints import UnsupportedEndpointError, parse_endpoint
from llm_batch.infra.log_context import bind_job, configure_plain_logging
from llm_batch.runtime.multinode import run_follower
from llm_batch.runtime.worker import WorkerUsageError, node_group, resolve_for_endpoint, run_worker
from llm_batch.runtime.worker_args import GROUP_FLAGS, WORKER_FLAGS, add_pod_command, config_from_args

FOLLOWER_DOC = """``llm-batch worker-follower``: a follower node of a multi-node shard worker.

Runs this node's part of the leader's vLLM engine (``llm_batch.runtime.multinode``) with the
leader's ``--model-config`` and ``--endpoint`` and the group's flags; reads and writes
nothing (the leader does) and exits when the engine's workers on this node end, with one of
``llm_batch.core.exit_codes``. Flags fall back to ``LLM_BATCH_WORKER_<FLAG>`` variables.
"""
_FOLLOWER_FLAGS: tuple[tuple[str, type, str], ...] = (
    ("--model-config", str, "JSON: the leader's --model-config"),
    ("--endpoint", str, "the leader's --endpoint (the model must serve it)"),
    ("--node-rank", int, "this node's rank in the group (1..nnodes-1; the leader is 0)"),
)


def register(subparsers: argparse._SubParsersAction) -> None:
    add_pod_command(subparsers, "worker", "run one shard on vLLM", __doc__, (*WORKER_FLAGS, *GROUP_FLAGS), worker)
    add_pod_command(subparsers, "worker-follower", "a follower node of a multi-node shard worker", FOLLOWER_DOC,
                    (*_FOLLOWER_FLAGS, *GROUP_FLAGS), follower)


def worker(args: argparse.Namespace) -> int:
    configure_plain_logging()
    try:
        config = config_from_args(args)
    except WorkerUsageError as exc:
        logging.getLogger("llm_batch.runtime.worker").error("%s", exc)
        return exit_codes.USAGE
    bind_job(config.job_id)
    return run_worker(config)


def follower(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    log = logging.getLogger("llm_batch.runtime.multinode")
    try:
        group = node_group(args.nnodes, args.node_rank, args.master_addr, args.master_port, args.gpus_per_node)
        if group is None:
            raise WorkerUsageError("--nnodes is required")
        model_config = orjson.loads(args.model_config or "null")
        if not isinstance(model_config, dict):
            raise WorkerUsageError("--model-config is required (a JSON object)")
        endpoint = parse_endpoint(args.endpoint or "")
    except (WorkerUsageError, UnsupportedEndpointError, orjson.JSONDecodeError) as exc:
        log.error("%s", exc)
        return exit_codes.USAGE
    try:
        model = resolve_for_endpoint(model_config, endpoint)
    except WorkerUsageError as exc:
        log.error("follower node %d cannot run: %s", group.node_rank, exc)
        return exit_codes.USAGE
    return run_follower(model, group)
