"""Check leapfx's floors: a package imports only packages on floors below it.

Reads every import in ``leapfx/`` with ``ast`` (module-level and function-level alike),
resolves relative imports, and reports

- an import of a higher floor (``file:line: leapfx.a imports leapfx.b (floor 3 -> 7)``);
- a circle between packages (imports that lead from a package back to itself).

The floors are those of docs/architecture.md, lowest first. A top-level module
(``textgen.py``, ``options.py``) is a package of its own. An import inside a function counts
as one at the top does: none may climb a floor or close a circle (what a floor needs from
one above is handed to it, as ``rewrite.apply`` hands a ``SpeculativeModel`` its lowering,
its exporter and its trainer). Exit status 1 when anything is reported.

    python tools/check_layers.py            # the report
    python tools/check_layers.py --summary  # counts per pair of packages only
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "leapfx"

FLOORS = [
    ("options", "files"),  # option checks, atomic writes: every floor shares them; no leapfx
    ("deploy",),  # onnxruntime, numpy and tokenizers only: no torch (the manifest lives here)
    ("kernels",),
    ("modules",),
    ("parts",),  # trained parts on disk: one format, one reader and writer; never a graph
    ("passes",),
    ("models",),
    ("runtime",),
    ("offload",),
    ("recipes",),  # the recipes as data: rewrite.apply builds with them, OnnxModel decodes
    ("lower",),
    ("export",),
    ("train",),  # fits what a recipe inserted in a SpeculativeModel; never applies a recipe
    ("rewrite",),
    ("runs",),  # training runs: a model loaded, a recipe applied, its parts fitted and written
    ("bench", "demo"),
    ("serve",),
    ("textgen",),
    ("cli",),
]
FLOOR = {name: i for i, names in enumerate(FLOORS) for name in names}


def package_of(module: str) -> str | None:
    """``leapfx.runtime.model`` -> ``runtime``; None outside leapfx or for leapfx itself."""
    parts = module.split(".")
    if parts[0] != PACKAGE or len(parts) < 2:
        return None
    return parts[1]


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports(path: Path) -> list[tuple[int, str]]:
    """(line, absolute module) of every import in ``path``, at the top or in a function."""
    tree = ast.parse(path.read_text(), str(path))
    here = module_name(path)
    is_package = path.name == "__init__.py"
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here.split(".")
                base = base if is_package else base[:-1]
                base = base[: len(base) - (node.level - 1)]
                target = ".".join([*base, node.module] if node.module else base)
            else:
                target = node.module or ""
            found.append((node.lineno, target))
            # `from . import x` and `from leapfx import x` may import a submodule x: count it
            # as that module too.
            folder = ROOT.joinpath(*target.split("."))
            found += [
                (node.lineno, f"{target}.{a.name}")
                for a in node.names
                if (folder / f"{a.name}.py").is_file() or (folder / a.name).is_dir()
            ]
    return found


def check(root: Path = ROOT) -> tuple[list[str], list[str], dict]:
    """(upward imports, circles, counts per package pair)."""
    upward, edges, counts = [], defaultdict(set), defaultdict(int)
    for path in sorted((root / PACKAGE).rglob("*.py")):
        src = package_of(module_name(path))
        if src is None:
            continue
        for line, target in imports(path):
            dst = package_of(target)
            if dst is None or dst == src:
                continue
            counts[src, dst] += 1
            edges[src].add(dst)
            if FLOOR.get(dst, -1) > FLOOR.get(src, -1):
                upward.append(
                    f"{path.relative_to(root)}:{line}: leapfx.{src} imports {target} (floor "
                    f"{FLOOR.get(src, '?')} -> {FLOOR.get(dst, '?')})"
                )
    return upward, _circles(edges), counts


def _circles(edges: dict[str, set[str]]) -> list[str]:
    """Strongly connected groups of packages (Tarjan), each as a sorted name list."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                out.append(" <-> ".join(sorted(group)))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--summary", action="store_true", help="counts per package pair")
    args = parser.parse_args(argv)
    upward, circles, counts = check()
    if args.summary:
        for (src, dst), n in sorted(counts.items()):
            mark = " UP" if FLOOR.get(dst, -1) > FLOOR.get(src, -1) else ""
            print(f"{src:>8} -> {dst:<8} {n:4d}{mark}")
    else:
        for line in upward:
            print(line)
    for c in circles:
        print(f"circle between packages: {c}")
    print(f"{len(upward)} upward imports, {len(circles)} circles", file=sys.stderr)
    return 1 if upward or circles else 0


if __name__ == "__main__":
    sys.exit(main())
