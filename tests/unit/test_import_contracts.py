"""The code's own imports keep the rules the README's module map states: the import contracts
of pyproject.toml ([tool.importlinter]: each folder of src/llm_batch a layer importing only the
layers below it, no circles, Airflow and vLLM only where they belong), no unused or undefined
names (pyflakes), imports in one order (ruff's isort rules), and an import inside a function
only where it keeps something heavy or optional out of a light import path, saying why in one
word (REASONS)."""

from __future__ import annotations

import ast
import io
import subprocess
import sys
import tokenize
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent

# Why an import is made inside a function, in one word (a trailing comment on its first line):
# what importing it at the top would pull into a path that must stay light (a DAG file's
# parse, the CLI, the plugin every Airflow process loads, the inference image).
REASONS = {
    "airflow",     # Airflow, or a module of llm_batch.airflow / Airflow's API server
    "vllm",        # vLLM, or a module importing it (llm_batch.runtime.engine.runner)
    "kubernetes",  # the Kubernetes client, or the pod/group operators and specs importing it
    "optional",    # a dependency of an extra only (scipy, Pillow, pypdfium2, jinja2, ...)
    "heavy",       # slow to import for the light path it sits on (SQLAlchemy's job store, boto3, httpx/rich, torch)
    "cycle",       # the two modules import each other at import time
}


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


def _in_function_imports(tree: ast.AST):
    """(import node, function name) for every import statement made inside a function."""
    def visit(node: ast.AST, func: str | None):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)) and func is not None:
                yield child, func
            inner = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else func
            yield from visit(child, inner)
    yield from visit(tree, None)


def test_in_function_imports_say_why():
    missing = []
    for path in sorted([*(REPO / "src").rglob("*.py"), *(REPO / "dags").rglob("*.py")]):
        text = path.read_text()
        comments = {tok.start[0]: tok.string for tok in tokenize.generate_tokens(io.StringIO(text).readline)
                    if tok.type == tokenize.COMMENT}
        for node, func in _in_function_imports(ast.parse(text)):
            words = {comments[n].lstrip("#").strip() for n in range(node.lineno, node.end_lineno + 1) if n in comments}
            if not words & REASONS:
                missing.append(f"{path.relative_to(REPO)}:{node.lineno} in {func}(): {ast.unparse(node)}")
    assert not missing, ("imports inside a function without a reason (# " + " | # ".join(sorted(REASONS))
                         + "; or move them to the top of the module):\n" + "\n".join(missing))
