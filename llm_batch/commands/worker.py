"""``llm-batch worker``: run one shard on vLLM's offline engine (the inference image entrypoint).

Every flag falls back to an ``LLM_BATCH_WORKER_<FLAG>`` environment variable (e.g.
``--model-config`` <- ``LLM_BATCH_WORKER_MODEL_CONFIG``), so a pod spec can pass either.
The exit status is one of ``llm_batch.exit_codes``.
"""

from __future__ import annotations

import argparse
import logging
import os
from typing import TYPE_CHECKING

from llm_batch.endpoints import SUPPORTED_ENDPOINTS
from llm_batch.job_request import DIALECTS

if TYPE_CHECKING:
    from llm_batch.worker import WorkerConfig

ENV_PREFIX = "LLM_BATCH_WORKER_"

# (flag, type, help); defaults come from the environment.
_FLAGS: tuple[tuple[str, type, str], ...] = (
    ("--job-id", str, "the job's id"),
    ("--shard", int, "the shard's index (0-based)"),
    ("--endpoint", str, "one of " + ", ".join(SUPPORTED_ENDPOINTS)),
    ("--model-config", str, "JSON: model plus any field of llm_batch.model_registry.MODEL_CONFIG_FIELDS "
                            "(checkpoint_path, max_model_len, dtype, seed, ..., engine_args)"),
    ("--requests", str, "URI of the shard's BatchRequest lines (default: the job layout's)"),
    ("--results", str, "URI prefix of the shard's result parts (default: the job layout's)"),
    ("--progress", str, "URI of the progress object (default: the job layout's)"),
    ("--cancel-marker", str, "URI whose existence cancels the shard (default: the job layout's)"),
    ("--deadline", float, "epoch seconds after which the shard stops (exit DEADLINE)"),
    ("--dialect", str, "the API the job came in through (" + ", ".join(DIALECTS) + "; default mistral): where "
                       "APIs answer an endpoint differently (/v1/moderations), the results take its shape"),
    ("--work-uri", str, "work prefix the default URIs live under (default: LLM_BATCH_WORK_URI)"),
    ("--window", int, "max requests between fed and written (default: 4 x max_num_seqs)"),
    ("--flush-every-s", float, "publish a results part at least this often (default 2)"),
    ("--flush-every-records", int, "... or every this many results (default 1000)"),
    ("--progress-interval-s", float, "seconds between progress updates (default 2)"),
)

# A multi-node worker's flags (llm_batch.multinode), the leader's and the followers' alike.
GROUP_FLAGS: tuple[tuple[str, type, str], ...] = (
    ("--nnodes", int, "nodes of a multi-node worker (>= 2; leave out for a one-node worker)"),
    ("--master-addr", str, "a multi-node worker's leader address (torch.distributed rendezvous)"),
    ("--master-port", int, "... and port (default 29501)"),
    ("--gpus-per-node", int, "GPUs on each node of a multi-node worker (its tensor-parallel size)"),
)


def _env(flag: str) -> str | None:
    return os.environ.get(ENV_PREFIX + flag.lstrip("-").replace("-", "_").upper())


def add_pod_command(subparsers: argparse._SubParsersAction, name: str, help_text: str, doc: str,
                    flags: tuple[tuple[str, type, str], ...], func) -> None:
    """A pod entrypoint's subcommand whose every flag falls back to its LLM_BATCH_WORKER_* variable."""
    parser = subparsers.add_parser(name, help=f"{help_text} (flags fall back to LLM_BATCH_WORKER_* variables)",
                                   description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    for flag, kind, text in flags:
        # Values stay strings from the environment; parse_config converts and names errors.
        parser.add_argument(flag, type=kind, default=_env(flag), help=text)
    parser.set_defaults(func=func)


def register(subparsers: argparse._SubParsersAction) -> None:
    add_pod_command(subparsers, "worker", "run one shard on vLLM", __doc__, (*_FLAGS, *GROUP_FLAGS), worker)


def worker(args: argparse.Namespace) -> int:
    from llm_batch import exit_codes
    from llm_batch.worker import WorkerUsageError, run_worker

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = _config(args)
    except WorkerUsageError as exc:
        logging.getLogger("llm_batch.worker").error("%s", exc)
        return exit_codes.USAGE
    return run_worker(config)


def config_from_argv(argv: list[str]) -> WorkerConfig:
    """The WorkerConfig of ``llm-batch worker`` arguments (a warm engine's request);
    WorkerUsageError when they are not a valid worker command."""
    from llm_batch.worker import WorkerUsageError

    parser = argparse.ArgumentParser(prog="llm-batch", exit_on_error=False)
    register(parser.add_subparsers(dest="command", required=True))
    try:
        args = parser.parse_args([str(a) for a in argv])
    except (argparse.ArgumentError, SystemExit) as exc:
        raise WorkerUsageError(f"not worker arguments: {exc}") from None
    return _config(args)


def _config(args: argparse.Namespace) -> WorkerConfig:
    from llm_batch.worker import parse_config

    values = vars(args).copy()
    for key in ("command", "func"):
        values.pop(key, None)
    return parse_config(**values)
