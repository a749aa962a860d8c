"""``leapfx bench --compare OLD.json``: the ratios of this run that fell against an earlier run's
``--json``, by more than they move on their own.

A row's ratio is its tokens/s over the ``leapfx_autoregressive`` row on the same backend in the
same run (``leapfx_layerskip@onnxruntime`` over ``leapfx_autoregressive@onnxruntime``): a
ratio measured side by side, which a machine's speed between runs cancels out of. Its spread is
half the range of the same ratio pass by pass (``seconds_per_pass``), and never less than
``MIN_SPREAD`` of the ratio (a one-pass run has no range of its own). A ratio fell when the old
one minus the new one exceeds the larger of the two spreads.

``--compare`` without a file compares with the run recorded for this model and prompt set,
``docs/bench/<model>-<prompt set>.json`` in leapfx's checkout (:func:`recorded`): the
``--json`` of the run docs/benchmarks.md and docs/quantized.md quote.

    >>> old = [{"system": "leapfx_autoregressive", "tokens_per_second": 10.0},
    ...        {"system": "leapfx_layerskip", "tokens_per_second": 15.6}]
    >>> new = [{"system": "leapfx_autoregressive", "tokens_per_second": 20.0},
    ...        {"system": "leapfx_layerskip", "tokens_per_second": 25.4}]
    >>> [(d.system, round(d.old, 2), round(d.new, 2)) for d in drops(new, old)]
    [('leapfx_layerskip', 1.56, 1.27)]
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

AUTOREGRESSIVE = "leapfx_autoregressive"
MIN_SPREAD = 0.03  # a ratio's spread is at least 3% of it
# The recorded runs (docs/bench/ of the checkout leapfx is installed from)
RECORDED = Path(__file__).resolve().parents[2] / "docs" / "bench"


def recorded(model: str | None, prompt_set: str, folder: Path = RECORDED) -> Path:
    """The recorded run of ``model`` (None: the reference model) on ``prompt_set``, or a
    ValueError naming the runs there are."""
    name = f"{model or 'reference'}-{prompt_set}.json"
    path = folder / name
    if path.is_file():
        return path
    there = sorted(p.stem for p in folder.glob("*.json")) if folder.is_dir() else []
    raise ValueError(
        f"--compare: no run is recorded for --model {model or 'reference'} --prompt-set "
        f"{prompt_set} ({folder / name} is missing; recorded: {', '.join(there) or 'none'}); "
        "allowed: --compare OLD.json, a file `leapfx bench --json` wrote"
    )


@dataclass(frozen=True)
class Ratio:
    value: float
    spread: float


@dataclass(frozen=True)
class Drop:
    system: str
    old: float
    new: float
    spread: float

    def line(self) -> str:
        return (
            f"  {self.system}: {self.old:.2f}x -> {self.new:.2f}x its autoregressive row "
            f"(fell {self.old - self.new:.2f}; spread {self.spread:.2f})"
        )


def _per_pass(row: dict) -> list[float]:
    n = row.get("new_tokens") or 0
    return [n / s for s in row.get("extra", {}).get("seconds_per_pass", []) if s > 0]


def ratios(rows: list[dict]) -> dict[str, Ratio]:
    """Each row's ratio over its backend's ``leapfx_autoregressive`` (rows with none: left out)."""
    by = {r["system"]: r for r in rows}
    out = {}
    for name, row in by.items():
        backend = name.partition("@")[2]
        ar = by.get(AUTOREGRESSIVE + (f"@{backend}" if backend else "")) or by.get(AUTOREGRESSIVE)
        if ar is None or ar is row or not ar["tokens_per_second"]:
            continue
        value = row["tokens_per_second"] / ar["tokens_per_second"]
        passes = [a / b for a, b in zip(_per_pass(row), _per_pass(ar), strict=False) if b]
        half_range = (max(passes) - min(passes)) / 2 if len(passes) > 1 else 0.0
        # eager, the default backend, names its rows without "@eager" in a one-backend run
        out[name.removesuffix("@eager")] = Ratio(value, max(half_range, MIN_SPREAD * value))
    return out


def drops(new: list[dict], old: list[dict]) -> list[Drop]:
    """The rows of ``new`` whose ratio fell against ``old``'s by more than its spread."""
    before, after = ratios(old), ratios(new)
    found = []
    for name, now in after.items():
        then = before.get(name)
        if then is None:
            continue
        spread = max(then.spread, now.spread)
        if then.value - now.value > spread:
            found.append(Drop(name, then.value, now.value, spread))
    return found


def read_rows(path: str | Path) -> list[dict]:
    """An earlier ``--json``'s rows, or a ValueError naming the option and what it holds."""
    try:
        rows = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"--compare: {str(path)!r} cannot be read as a bench JSON ({e}); "
                         "allowed: a file `leapfx bench --json` wrote") from None  # fmt: skip
    if not isinstance(rows, list) or not all(isinstance(r, dict) and "system" in r for r in rows):
        raise ValueError(f"--compare: {str(path)!r} holds no bench rows; allowed: a file "
                         "`leapfx bench --json` wrote")  # fmt: skip
    return rows


def _differs(new: list[dict], old: list[dict]) -> str:
    """The settings of the two runs that differ (model, prompts, weights ...), as a clause."""
    keys = ("model", "prompt_set", "prompts", "max_new_tokens", "weights", "threads", "backend")
    a, b = (next((r["run"] for r in rows if "run" in r), {}) for rows in (new, old))
    diff = [f"{k} {b.get(k)!r} then, {a.get(k)!r} now" for k in keys if a.get(k) != b.get(k)]
    return f"; the runs differ in {', '.join(diff)}" if a and b and diff else ""


def report(new: list[dict], old_path: str | Path) -> str:
    """What ``--compare`` prints under the table."""
    old = read_rows(old_path)
    common = set(ratios(new)) & set(ratios(old))
    found = drops(new, old)
    head = (
        f"compared with {old_path} ({len(common)} ratios over leapfx_autoregressive in both"
        f"{_differs(new, old)}):"
    )
    if not found:
        return f"{head} none fell by more than its spread"
    return "\n".join(
        [f"{head} {len(found)} fell by more than their spread", *(d.line() for d in found)]
    )
