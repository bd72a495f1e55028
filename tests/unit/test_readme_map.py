"""The README's module map names every module of the package, each in its folder's row, and
names no module that does not exist (so the map stays the way into the code)."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "src" / "llm_batch"


def _rows() -> dict[str, str]:
    """{folder under src/llm_batch (e.g. "api/native"): the row's modules cell}."""
    text = (REPO / "README.md").read_text()
    section = text.split("## Module map", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        cells = line.split("|")
        if len(cells) < 4 or not cells[1].strip().startswith("`"):
            continue
        for folder in re.findall(r"`([a-z_/]+)/`", cells[1]):
            rows[folder] = cells[2]
    return rows


def _modules() -> list[Path]:
    return sorted(p.relative_to(PACKAGE) for p in PACKAGE.rglob("*.py")
                  if p.name != "__init__.py" and "migrations" not in p.parts)


def _row_of(module: Path, rows: dict[str, str]) -> str:
    folders = [f for f in rows if module.parent.as_posix() == f or module.parent.as_posix().startswith(f + "/")]
    assert folders, f"{module}: no row of the README's module map covers its folder"
    return max(folders, key=len)


def test_every_module_is_in_its_folders_row():
    rows = _rows()
    missing = [str(m) for m in _modules() if f"`{m.name}`" not in rows[_row_of(m, rows)]]
    assert missing == [], f"modules the README's module map does not name: {missing}"


def test_the_map_names_no_module_that_is_gone():
    rows = _rows()
    named = {(folder, name) for folder, cell in rows.items() for name in re.findall(r"`([a-z_0-9]+\.py)`", cell)}
    existing = {(_row_of(m, rows), m.name) for m in _modules()}
    # A row may name a module of another row's folder in passing (e.g. "as dags/x.py does").
    gone = sorted(f"{folder}: {name}" for folder, name in named
                  if not any(n == name for _, n in existing) and not (REPO / folder / name).exists())
    assert gone == [], f"the README's module map names modules that do not exist: {gone}"
