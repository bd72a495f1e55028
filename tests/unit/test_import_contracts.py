"""The code's own imports keep the rules the README's module map states: the import contracts
of pyproject.toml ([tool.importlinter]: no circles, the core free of Airflow, the provider
and the plugin), and no unused or undefined names (pyflakes)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def test_the_import_contracts_are_kept():
    checked = subprocess.run([BIN / "lint-imports", "--no-cache"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert checked.returncode == 0, checked.stdout[-4000:] + checked.stderr[-2000:]
    assert "0 broken" in checked.stdout


def test_no_unused_or_undefined_names():
    checked = subprocess.run([sys.executable, "-m", "pyflakes", "llm_batch", "operators", "plugins", "dags"],
                             cwd=REPO, capture_output=True, text=True, timeout=300)
    assert checked.returncode == 0 and not checked.stdout, checked.stdout[-4000:] + checked.stderr[-2000:]
