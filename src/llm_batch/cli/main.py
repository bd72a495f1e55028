"""The ``llm-batch`` command: one entry point, its subcommands in the modules of ``COMMANDS``.

Each module's ``register(subparsers)`` adds its subcommands, each with a ``func`` (called with
the parsed args; returns the exit status) that imports what is heavy when it runs.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from llm_batch.core.config import Settings

COMMANDS: tuple[str, ...] = (
    "llm_batch.cli.validate",
    "llm_batch.cli.estimate",
    "llm_batch.cli.models",
    "llm_batch.cli.stack",
    "llm_batch.cli.steps",
    "llm_batch.cli.api_key",
    "llm_batch.cli.worker",
    "llm_batch.cli.engine_service",
    "llm_batch.cli.jobs",
    "llm_batch.cli.retry",
    "llm_batch.cli.usage",
    "llm_batch.cli.webhook",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="llm-batch", description=__doc__.splitlines()[0])
    subparsers = parser.add_subparsers(dest="command", required=True)
    for name in COMMANDS:
        importlib.import_module(name).register(subparsers)
    return parser


def main(argv: list[str] | None = None, settings: Settings | None = None,
         env: Mapping[str, str] | None = None) -> int:
    """Run the command ``argv`` (default: this process's arguments) with ``settings`` (None:
    ``get_settings()``) and ``env``, variables over this process's environment (the batch API's
    URL and key), for a caller that runs commands in its own process."""
    args = build_parser().parse_args(argv)
    args.settings = settings
    args.environ = {**os.environ, **env} if env is not None else None
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
