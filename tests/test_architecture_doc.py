"""docs/architecture.md is drawn from the code: every module it names exists, and every module
of leapfx/ is named in its package's row of "The packages".

A row of that table starts with its package (`leapfx/runtime/`) or top-level modules
(`leapfx/options.py`); a `name.py` in a row is a module of the row's package, a `pkg/name.py`
anywhere in the page a module of leapfx/pkg. In "One row per paper" a column's header names
its package (`passes (`passes/`)`), and a `name.py` in that column is a module of it.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "architecture.md"
LEAPFX = ROOT / "leapfx"

CELL_MODULE = re.compile(r"`([\w/]+\.py)`")  # `model.py`, `runtime/model.py`
PATH = re.compile(r"`((?:[a-z_]+/)+(?:\w+\.py)?)`")  # `leapfx/lower/`, `lower/x.py`, `tools/x.py`
TOP = ("leapfx/", "tools/", "tests/", "docs/")  # paths from the repository's root; others: leapfx/


def _section(text: str, title: str) -> list[str]:
    lines = text.splitlines()
    start = lines.index(f"## {title}") + 1
    end = next((i for i in range(start, len(lines)) if lines[i].startswith("## ")), len(lines))
    return lines[start:end]


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def _package_rows(text: str) -> dict[str, str]:
    """``runtime/`` or ``options.py`` (a row's subject, relative to leapfx/) -> the row."""
    rows = {}
    for line in _section(text, "The packages"):
        if not line.startswith("| `leapfx/"):
            continue
        subject = _cells(line)[0]
        for name in re.findall(r"`leapfx/([\w/.]+)`", subject):
            rows[name] = line
    return rows


def _resolve(name: str, package: str) -> Path:
    """A module name of the doc as a file: ``x.py`` in ``package``, ``pkg/x.py`` in leapfx/."""
    return LEAPFX / name if "/" in name else LEAPFX / package / name


def _tree() -> dict[str, list[str]]:
    """package (``runtime/``; ``""`` for leapfx/ itself) -> its modules' file names."""
    out: dict[str, list[str]] = {}
    for path in sorted(LEAPFX.rglob("*.py")):
        rel = path.relative_to(LEAPFX)
        package = "".join(f"{p}/" for p in rel.parts[:-1])
        out.setdefault(package, []).append(rel.name)
    return out


def test_every_module_of_leapfx_is_named_in_its_packages_row():
    rows = _package_rows(DOC.read_text())
    missing = []
    for package, names in _tree().items():
        for name in names:
            if package == "":
                if name != "__init__.py" and name not in rows:
                    missing.append(name)
                continue
            if package not in rows:
                missing.append(f"{package} (no row)")
                break
            named = {m.rsplit("/", 1)[-1] for m in CELL_MODULE.findall(rows[package])}
            if name != "__init__.py" and name not in named:
                missing.append(package + name)
    assert not missing, f"docs/architecture.md does not name: {', '.join(missing)}"


def test_every_module_the_packages_rows_name_exists():
    wrong = []
    for subject, row in _package_rows(DOC.read_text()).items():
        if not subject.endswith("/"):
            continue
        body = "|".join(_cells(row)[1:])
        for name in CELL_MODULE.findall(body):
            if not _resolve(name, subject).is_file():
                wrong.append(f"{name} (row {subject})")
    assert not wrong, f"docs/architecture.md names modules that do not exist: {wrong}"


def test_every_module_the_papers_table_names_exists():
    lines = [x for x in _section(DOC.read_text(), "One row per paper") if x.startswith("|")]
    header = _cells(lines[0])
    packages = [re.search(r"\(`([a-z_]+/)`\)", h) for h in header]
    wrong = []
    for line in lines[2:]:
        for cell, package in zip(_cells(line), packages, strict=True):
            if package is None:
                continue
            for name in CELL_MODULE.findall(cell):
                if not _resolve(name, package.group(1)).is_file():
                    wrong.append(f"{name} ({package.group(1)} column)")
    assert not wrong, f"docs/architecture.md's papers table names missing modules: {wrong}"


def test_every_path_the_page_names_exists():
    wrong = []
    for name in PATH.findall(DOC.read_text()):
        path = (ROOT if name.startswith(TOP) else LEAPFX) / name
        if not (path.is_dir() if name.endswith("/") else path.is_file()):
            wrong.append(name)
    assert not wrong, f"docs/architecture.md names paths that do not exist: {wrong}"
