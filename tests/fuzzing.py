"""How many examples a property test draws: its full count in the whole suite (CI), a third
in the quick lane (``scripts/test.sh --quick`` sets LLM_BATCH_TEST_LANE=quick). Hypothesis's
docs advise the same split: a light profile for the edit loop, the full search in CI."""

from __future__ import annotations

import os

SHARE = 1 / 3 if os.environ.get("LLM_BATCH_TEST_LANE") == "quick" else 1.0


def examples(full: int) -> int:
    """`full` examples in the whole suite, a share of them in the quick lane (at least 1)."""
    return max(1, round(full * SHARE))
