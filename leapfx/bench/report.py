"""Report of a bench run: the table, ``--json`` rows, the ``--plot`` PNG and ``--markdown``.

``--markdown PATH`` keeps results pages regenerated rather than hand-copied: the report the bench
printed goes into PATH between two marker lines, headed by the command, the date, the machine and
the library versions. A PATH that exists must already hold the markers (README.md and
docs/benchmarks.md do); only the text between them is replaced. A new PATH is written as the
block alone, markers included, so it can be regenerated the same way.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import io
import json
import os
import platform
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm

from .. import files


@dataclass
class Row:
    """One system's line of the report (and of ``--json``)."""

    system: str
    tokens_per_second: float
    speedup: float = 1.0
    mean_accepted_tokens: float | None = None
    acceptance_rate: float | None = None
    ctar: list[float] | None = None
    identical_to_greedy: bool | None = None  # lossless systems, greedy runs: every prompt
    identical_prompts: int | None = None  # ... how many of ``prompts`` are token-identical
    prompts: int | None = None
    # ... per differing prompt: where the outputs part and whether it is a near-tie flip
    # ({"prompt": i, **leapfx.bench.ties.first_difference(...)})
    differences: list[dict] | None = None
    speedup_vs_static: float | None = None  # tokens/s over hf_static's (when it ran)
    agreement_with_greedy: float | None = None  # lossy systems: share of equal tokens
    # Lossy systems, greedy runs: teacher-forced agreement with the baseline's tokens
    # (leapfx.bench.agreement) and decoder layers run per token under it.
    agreement: float | None = None
    avg_layers: float | None = None  # every leapfx row that records it (timed pass)
    distribution_check: str | None = None  # sampling runs
    new_tokens: int = 0
    seconds: float = 0.0
    extra: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if v is not None}


def progress_bar(iterable=None, *, enabled: bool, **kwargs) -> tqdm:
    """A tqdm bar on stderr, never stdout, which holds the report.

    What was printed before the bar is flushed first: with stdout and stderr sent to one file,
    stdout's block buffer would otherwise land after the bar's lines. Callers close the bar before
    the report is printed, so the report follows every bar. Whether bars show at all is the
    caller's choice (the CLI: only when stderr is a terminal, unless ``--progress``).
    """
    if enabled:
        sys.stdout.flush()
    return tqdm(iterable, file=sys.stderr, disable=not enabled, **kwargs)


def _fmt(value, spec: str = ".2f") -> str:
    return "-" if value is None else format(value, spec)


def identical(row: Row) -> str:
    """The ``identical`` cell of a lossless row: ``n/m`` prompts token-identical to the
    baseline, and for the others how many are near-tie flips (``leapfx.bench.ties``)."""
    text = f"{row.identical_prompts}/{row.prompts}"
    if row.differences:
        ties = sum(d["near_tie"] for d in row.differences)
        others = len(row.differences) - ties
        parts = [f"{ties} near-tie flip{'s' * (ties != 1)}"] if ties else []
        parts += [f"{others} NOT a tie"] if others else []
        text += f" ({', '.join(parts)})"
    return text


def table(rows: list[Row]) -> str:
    """A plain-text table of the rows (what ``leapfx bench`` prints)."""
    d = max((len(r.ctar) for r in rows if r.ctar), default=0)
    head = ["system", "tok/s", "speedup", "mean acc", "accept", f"CTAR(1..{d})", "identical"]
    static = any(r.speedup_vs_static is not None for r in rows)
    if static:
        head.insert(3, "vs static")
    lines = []
    for r in rows:
        if r.identical_prompts is not None:
            same = identical(r)
        elif r.identical_to_greedy is not None:
            same = "yes" if r.identical_to_greedy else "NO"
        elif r.agreement is not None:  # teacher-forced (lossy leapfx rows)
            same = f"agreement {r.agreement:.1%}"
            if r.avg_layers is not None:
                same += f", {r.avg_layers:.1f} layers"
        elif r.agreement_with_greedy is not None:
            same = f"agree {r.agreement_with_greedy:.1%}"
        elif r.distribution_check is not None:
            same = r.distribution_check
        else:
            same = "(baseline)" if r is rows[0] else "-"
        ctar = " ".join(f"{c:.2f}" for c in r.ctar) if r.ctar else "-"
        lines.append([
            r.system, f"{r.tokens_per_second:.1f}", f"{r.speedup:.2f}x",
            _fmt(r.mean_accepted_tokens), _fmt(r.acceptance_rate), ctar, same,
        ])  # fmt: skip
        if static:
            vs = r.speedup_vs_static
            lines[-1].insert(3, "-" if vs is None else f"{vs:.2f}x")
    return columns(head, lines)


def columns(head: list[str], lines: list[list]) -> str:
    """``head`` and ``lines`` as left-aligned plain-text columns under a rule."""
    widths = [max(len(str(x)) for x in col) for col in zip(head, *lines, strict=True)]
    out = ["  ".join(h.ljust(w) for h, w in zip(head, widths, strict=True))]
    out.append("  ".join("-" * w for w in widths))
    out += ["  ".join(str(x).ljust(w) for x, w in zip(line, widths, strict=True)) for line in lines]
    return "\n".join(out)


def write_atomic(path: str | Path, data: bytes) -> None:
    """``data`` into ``path`` whole or not at all (``leapfx.files``); its directory exists."""
    path = Path(path)
    if not path.parent.is_dir():
        raise ValueError(f"output path {str(path)!r}: its directory does not exist")
    files.write_atomic(path, lambda tmp: tmp.write_bytes(data))


def write_figure(path: str | Path, fig, dpi: int = 110) -> None:
    """Render a matplotlib figure to PNG bytes, close it, and write it with ``write_atomic``."""
    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    plt.close(fig)
    write_atomic(path, buf.getvalue())


def write_json(path: str | Path, rows: list[Row], meta: dict) -> None:
    """``--json``: a list of row dicts; run settings are repeated in each row's ``run`` field."""
    payload = [{**r.as_dict(), "run": meta} for r in rows]
    write_atomic(path, json.dumps(payload, indent=2).encode())


def write_plot(path: str | Path, rows: list[Row], acceptance_by_exit: dict[int, float]) -> None:
    """``--plot``: speedup per system, and acceptance rate against the exit layer."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    names = [r.system for r in rows]
    a.barh(names, [r.speedup for r in rows], color="tab:blue")
    a.axvline(1.0, color="gray", lw=1)
    a.set_xlabel("speedup vs HF greedy (tokens/s ratio)")
    a.invert_yaxis()
    if acceptance_by_exit:
        xs = sorted(acceptance_by_exit)
        b.plot(xs, [acceptance_by_exit[x] for x in xs], marker="o")
    b.set_xlabel("exit layer E")
    b.set_ylabel("acceptance rate")
    b.set_ylim(0, 1)
    b.grid(alpha=0.3)
    fig.tight_layout()
    write_figure(path, fig)


MARKDOWN_BEGIN = "<!-- bench:begin -->"
MARKDOWN_END = "<!-- bench:end -->"


def machine(device: str = "cpu", threads: int | None = None) -> str:
    """What ran the bench, in words: the GPU's name, or the CPU model and its core count."""
    if device.startswith("cuda") and torch.cuda.is_available():
        return f"{torch.cuda.get_device_name(torch.device(device))} (CUDA {torch.version.cuda})"
    name = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            name = next(
                line.split(":", 1)[1].strip() for line in f if line.startswith("model name")
            )
    except (OSError, StopIteration):
        pass
    used = f", {threads} torch threads" if threads is not None else ""
    return f"{name}, {os.cpu_count()} cores{used}, no GPU used"


def versions() -> str:
    """Versions of the libraries the bench's numbers depend on."""
    parts = []
    for dist in ("torch", "transformers", "onnxruntime"):
        try:
            parts.append(f"{dist} {importlib.metadata.version(dist)}")
        except importlib.metadata.PackageNotFoundError:
            parts.append(f"{dist} not installed")
    return ", ".join(parts) + f", Python {platform.python_version()}"


def markdown_block(
    report: str,
    *,
    command: str,
    device: str = "cpu",
    threads: int | None = None,
    when: datetime.datetime | None = None,
) -> str:
    """The ``--markdown`` block: markers, a header line, the command and the printed report."""
    when = when or datetime.datetime.now(datetime.timezone.utc)
    header = (
        f"Measured {when:%Y-%m-%d %H:%M} UTC on {machine(device, threads)}; {versions()}. "
        "Written by `leapfx bench --markdown`, not by hand."
    )
    fence = "`" * max(3, _longest_backtick_run(report) + 1)
    return "\n".join([
        MARKDOWN_BEGIN, header, "", "```bash", command, "```", "", fence + "text",
        report.rstrip("\n"), fence, MARKDOWN_END,
    ])  # fmt: skip


def _longest_backtick_run(text: str) -> int:
    run = best = 0
    for ch in text:
        run = run + 1 if ch == "`" else 0
        best = max(best, run)
    return best


def check_markdown_target(path: str | Path) -> None:
    """Refuse, before a long run, a PATH that ``write_markdown`` could not update."""
    path = Path(path)
    if not path.parent.is_dir():
        raise ValueError(f"--markdown: the directory of {str(path)!r} does not exist")
    if path.exists():
        _split_at_markers(path.read_text(), path)


def _split_at_markers(text: str, path: Path) -> tuple[str, str]:
    if text.count(MARKDOWN_BEGIN) != 1 or text.count(MARKDOWN_END) != 1:
        raise ValueError(
            f"--markdown: {str(path)!r} exists but does not hold one {MARKDOWN_BEGIN} line and "
            f"one {MARKDOWN_END} line after it; allowed: a new file, or one with both markers "
            "(the block between them is replaced)"
        )
    head, rest = text.split(MARKDOWN_BEGIN)
    if MARKDOWN_END not in rest:
        raise ValueError(
            f"--markdown: in {str(path)!r} {MARKDOWN_END} comes before {MARKDOWN_BEGIN}"
        )
    return head, rest.split(MARKDOWN_END, 1)[1]


def write_markdown(path: str | Path, block: str) -> None:
    """Put ``block`` between the markers of ``path`` (or write it as a new file), atomically."""
    path = Path(path)
    check_markdown_target(path)
    if path.exists():
        head, tail = _split_at_markers(path.read_text(), path)
        text = head + block + tail
    else:
        text = block + "\n"
    write_atomic(path, text.encode())
