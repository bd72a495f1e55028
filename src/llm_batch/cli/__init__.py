"""The ``llm-batch`` subcommands (their modules are listed in ``llm_batch.cli.main.COMMANDS``)."""

from __future__ import annotations

import sys
from collections.abc import Sequence


def print_table(rows: Sequence[Sequence[str]]) -> None:
    """Print rows (the first is the header) as left-aligned columns two spaces apart."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())


def fail(message: str, status: int = 2) -> int:
    """Say ``error: <message>`` on stderr; returns the exit status (2: a usage or HTTP error)."""
    print(f"error: {message}", file=sys.stderr)
    return status
