"""The command line of a shard worker (``llm-batch worker``, ``llm-batch follower``): its flags,
each falling back to an ``LLM_BATCH_WORKER_<FLAG>`` environment variable, and their parsing
into a WorkerConfig. The CLI registers them; a warm engine parses a shard's argv with them.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping

from llm_batch.core.endpoints import SUPPORTED_ENDPOINTS
from llm_batch.runtime.worker import WorkerConfig, WorkerUsageError, parse_config

ENV_PREFIX = "LLM_BATCH_WORKER_"

# (flag, type, help); defaults come from the environment.
WORKER_FLAGS: tuple[tuple[str, type, str], ...] = (
    ("--job-id", str, "the job's id"),
    ("--shard", int, "the shard's index (0-based)"),
    ("--endpoint", str, "one of " + ", ".join(SUPPORTED_ENDPOINTS)),
    ("--model-config", str, "JSON: model plus any field of llm_batch.core.model_config.MODEL_CONFIG_FIELDS "
                            "(checkpoint_path, max_model_len, dtype, seed, ..., engine_args)"),
    ("--requests", str, "URI of the shard's BatchRequest lines (default: the job layout's)"),
    ("--results", str, "URI prefix of the shard's result parts (default: the job layout's)"),
    ("--progress", str, "URI of the progress object (default: the job layout's)"),
    ("--cancel-marker", str, "URI whose existence cancels the shard (default: the job layout's)"),
    ("--deadline", float, "epoch seconds after which the shard stops (exit DEADLINE)"),
    ("--options", str, "JSON: the job's options (llm_batch.core.job_spec.JobOptions: moderation_shape, "
                       "output_check, ...); default: none set"),
    ("--cache-salt", str, "the job owner's namespace in the engine's prefix cache (set by the server)"),
    ("--work-uri", str, "work prefix the default URIs live under (default: LLM_BATCH_WORK_URI)"),
    ("--window", int, "max requests between fed and written (default: 4 x max_num_seqs)"),
    ("--flush-every-s", float, "publish a results part at least this often (default 2)"),
    ("--flush-every-records", int, "... or every this many results (default 1000)"),
    ("--progress-interval-s", float, "seconds between progress updates (default 2)"),
)

# A multi-node worker's flags (llm_batch.runtime.multinode), the leader's and the followers' alike.
GROUP_FLAGS: tuple[tuple[str, type, str], ...] = (
    ("--nnodes", int, "nodes of a multi-node worker (>= 2; leave out for a one-node worker)"),
    ("--master-addr", str, "a multi-node worker's leader address (torch.distributed rendezvous)"),
    ("--master-port", int, "... and port (default 29501)"),
    ("--gpus-per-node", int, "GPUs on each node of a multi-node worker (its tensor-parallel size)"),
)


def _env(flag: str, environ: Mapping[str, str]) -> str | None:
    return environ.get(ENV_PREFIX + flag.lstrip("-").replace("-", "_").upper())


def add_pod_command(subparsers: argparse._SubParsersAction, name: str, help_text: str, doc: str,
                    flags: tuple[tuple[str, type, str], ...], func,
                    environ: Mapping[str, str] | None = None) -> None:
    """A pod entrypoint's subcommand whose every flag falls back to its LLM_BATCH_WORKER_* variable
    (of ``environ``, default this process's environment)."""
    environ = os.environ if environ is None else environ
    parser = subparsers.add_parser(name, help=f"{help_text} (flags fall back to LLM_BATCH_WORKER_* variables)",
                                   description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    for flag, kind, text in flags:
        # Values stay strings from the environment; parse_config converts and names errors.
        parser.add_argument(flag, type=kind, default=_env(flag, environ), help=text)
    parser.set_defaults(func=func)


def config_from_argv(argv: list[str]) -> WorkerConfig:
    """The WorkerConfig of ``llm-batch worker`` arguments (a warm engine's request);
    WorkerUsageError when they are not a valid worker command."""
    parser = argparse.ArgumentParser(prog="llm-batch", exit_on_error=False)
    add_pod_command(parser.add_subparsers(dest="command", required=True), "worker", "", "",
                    (*WORKER_FLAGS, *GROUP_FLAGS), None)
    try:
        args = parser.parse_args([str(a) for a in argv])
    except (argparse.ArgumentError, SystemExit) as exc:
        raise WorkerUsageError(f"not worker arguments: {exc}") from None
    return config_from_args(args)


def config_from_args(args: argparse.Namespace) -> WorkerConfig:
    values = vars(args).copy()
    for key in ("command", "func"):
        values.pop(key, None)
    return parse_config(**values)
