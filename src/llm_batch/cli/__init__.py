"""The ``llm-batch`` subcommands (their modules are listed in ``llm_batch.cli.main.COMMANDS``)."""

from __future__ import annotations

from collections.abc import Sequence


def print_table(rows: Sequence[Sequence[str]]) -> None:
    """Print rows (the first is the header) as left-aligned columns two spaces apart."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())
