"""The code's own imports keep the rules the README's module map states: the import contracts
of pyproject.toml ([tool.importlinter]: each folder of src/llm_batch a layer importing only the
layers below it, no circles, Airflow and vLLM only where they belong), no unused or undefined
names (pyflakes), and imports in one order (ruff's isort rules)."""

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
    checked = subprocess.run([sys.executable, "-m", "pyflakes", "src", "dags"],
                             cwd=REPO, capture_output=True, text=True, timeout=300)
    assert checked.returncode == 0 and not checked.stdout, checked.stdout[-4000:] + checked.stderr[-2000:]


def test_imports_are_in_order():
    checked = subprocess.run([BIN / "ruff", "check", "--no-cache", "src", "tests", "dags", "benchmarks", "scripts"],
                             cwd=REPO, capture_output=True, text=True, timeout=300)
    assert checked.returncode == 0, checked.stdout[-4000:] + checked.stderr[-2000:]
