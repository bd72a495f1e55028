"""``llm-batch worker``: run one shard on vLLM's offline engine (the inference image entrypoint).

Every flag falls back to an ``LLM_BATCH_WORKER_<FLAG>`` environment variable (e.g.
``--model-config`` <- ``LLM_BATCH_WORKER_MODEL_CONFIG``), so a pod spec can pass either.
The exit status is one of ``llm_batch.core.exit_codes``. The flags: ``llm_batch.runtime.worker_args``.
"""

from __future__ import annotations

import argparse
import logging

from llm_batch.core import exit_codes
from llm_batch.infra.log_context import bind_job, configure_plain_logging
from llm_batch.runtime.worker import WorkerUsageError, run_worker
from llm_batch.runtime.worker_args import GROUP_FLAGS, WORKER_FLAGS, add_pod_command, config_from_args


def register(subparsers: argparse._SubParsersAction) -> None:
    add_pod_command(subparsers, "worker", "run one shard on vLLM", __doc__, (*WORKER_FLAGS, *GROUP_FLAGS), worker)


def worker(args: argparse.Namespace) -> int:
    configure_plain_logging()
    try:
        config = config_from_args(args)
    except WorkerUsageError as exc:
        logging.getLogger("llm_batch.runtime.worker").error("%s", exc)
        return exit_codes.USAGE
    bind_job(config.job_id)
    return run_worker(config)
