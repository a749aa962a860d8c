"""``leapfx bench --recipe specee --sweep-threshold``: SpecEE's agreement-vs-speed curve.

Each point is one setting of a lossy system decoding the bench prompts greedily: its tokens/s
over ``leapfx_autoregressive`` on the same prompts (timed, best of ``repeats`` passes), its
teacher-forced agreement with the full model's greedy tokens (``leapfx.bench.agreement``) and
its decoder layers per token. SpecEE runs at every threshold of the grid, LayerSkip's fixed early
exit at every E: SpecEE earns its predictors only if its curve lies above fixed early exit at
equal speed (the issue's test, computed by :func:`above_early_exit`, not read off the plot).
SpecEE runs with both KV policies: ``specee`` (``kv_fill="next"``, the default) and
``specee_mask`` (``kv_fill="mask"``), which differ most in agreement.

    >>> points = threshold_sweep(model, prompts, greedy, thresholds=[0.5, 0.9], exits=[4, 8])
    >>> print(sweep_threshold_table(points))
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path

import torch

from .. import rewrite
from .agreement import teacher_forced_agreement
from .report import write_figure


@dataclass(frozen=True)
class CurvePoint:
    system: str  # "specee" (kv_fill="next"), "specee_mask" (kv_fill="mask") or "early_exit"
    setting: float  # the threshold, or E
    tokens_per_second: float
    speedup: float  # over leapfx_autoregressive on the same prompts
    agreement: float
    avg_layers: float | None
    predictor_share: float | None = None  # specee: predictor time / decode time

    def as_dict(self) -> dict:
        return asdict(self)


def _tokens_per_second(sm, prompts, max_new_tokens: int, repeats: int) -> tuple[float, float]:
    best, share = 0.0, None
    for _ in range(repeats):
        tokens, seconds, predictor = 0, 0.0, 0.0
        for p in prompts:
            start = time.perf_counter()
            sm.generate(p, max_new_tokens=max_new_tokens, do_sample=False)
            seconds += time.perf_counter() - start
            m = sm.last_metrics
            tokens += m.new_tokens
            predictor += m.stage_seconds.get("predictor", 0.0)
        if tokens / seconds > best:
            best, share = tokens / seconds, predictor / seconds
    return best, share


def threshold_sweep(
    model,
    prompts: list[torch.Tensor],
    greedy_outputs: list[torch.Tensor],
    *,
    thresholds: list[float],
    exits: list[int],
    specee_options: dict | None = None,
    max_new_tokens: int = 128,
    repeats: int = 1,
    cpu_kernels: bool = False,
) -> list[CurvePoint]:
    """Tokens/s, agreement and layers of specee at each threshold and early_exit at each E."""
    options = dict(specee_options or {})
    options.pop("threshold", None)
    options.pop("kv_fill", None)
    systems = [
        (system, t, partial(rewrite.apply, model, "specee", threshold=t, kv_fill=fill, **options))
        for system, fill in (("specee", "next"), ("specee_mask", "mask"))
        for t in thresholds
    ]
    systems += [(_EARLY, e, partial(rewrite.apply, model, _EARLY, exit_layer=e)) for e in exits]
    return measure_points(
        model, prompts, greedy_outputs, systems, max_new_tokens=max_new_tokens,
        repeats=repeats, cpu_kernels=cpu_kernels,
    )  # fmt: skip


_EARLY = "early_exit"


def measure_points(
    model,
    prompts: list[torch.Tensor],
    greedy_outputs: list[torch.Tensor],
    systems: list[tuple[str, float, Callable]],
    *,
    max_new_tokens: int,
    repeats: int = 1,
    cpu_kernels: bool = False,
) -> list[CurvePoint]:
    """One CurvePoint per ``(system, setting, make)`` (``make()`` builds the model): its best
    tokens/s of ``repeats`` passes over ``leapfx_autoregressive``'s timed right before it, its
    teacher-forced agreement and layers per token."""

    def prepare(sm):
        sm = sm.use_cpu_kernels(cpu_kernels)
        sm.generate(prompts[0], max_new_tokens=4)  # warm-up
        return sm

    base = prepare(rewrite.apply(model, "autoregressive"))
    points = []
    for system, setting, make in systems:
        sm = prepare(make())
        # The baseline is timed right before each point: on a shared machine the load drifts
        # over a sweep, and a ratio of neighbouring measurements drifts least.
        base_tps, _ = _tokens_per_second(base, prompts, max_new_tokens, repeats)
        tps, share = _tokens_per_second(sm, prompts, max_new_tokens, repeats)
        a = teacher_forced_agreement(sm, prompts, greedy_outputs)
        share = share if system.startswith("specee") else None
        points.append(CurvePoint(system, setting, tps, tps / base_tps, a.agreement,
                                 a.avg_layers, share))  # fmt: skip
    return points


@dataclass(frozen=True)
class Comparison:
    """One early-exit point against a SpecEE curve at the same speed (or the same layers)."""

    exit_layer: int
    x: float  # the early-exit point's speedup (or layers per token)
    early_exit: float  # its agreement
    specee: float | None  # the curve's agreement at x (linear between its points), None: outside

    @property
    def above(self) -> bool | None:
        return None if self.specee is None else self.specee >= self.early_exit


def _interpolate(xs: list[float], ys: list[float], x: float) -> float | None:
    """The piecewise-linear curve through (xs, ys) at x; None outside [min xs, max xs].

    Where the curve passes x more than once (a measured speedup need not fall as the threshold
    rises) the best agreement counts: that setting exists at that speed.

    >>> _interpolate([1.0, 2.0], [0.9, 0.8], 1.5)
    0.85
    """
    best = None
    for (x0, y0), (x1, y1) in zip(zip(xs, ys), zip(xs[1:], ys[1:])):  # noqa: B905
        lo, hi = min(x0, x1), max(x0, x1)
        if lo <= x <= hi:
            y = y0 if x1 == x0 else y0 + (y1 - y0) * (x - x0) / (x1 - x0)
            best = y if best is None else max(best, y)
    if best is None and len(xs) == 1 and xs[0] == x:
        best = ys[0]
    return best


def above_early_exit(
    points: list[CurvePoint], system: str = "specee", key: str = "speedup"
) -> list[Comparison]:
    """Each early-exit point against ``system``'s curve at the same ``key`` (``"speedup"`` or
    ``"avg_layers"``), thresholds in order. The claim holds where every comparison inside the
    curve's range is ``above``; points outside it compare nothing (``specee`` None)."""
    curve = sorted(
        (p for p in points if p.system == system and getattr(p, key) is not None),
        key=lambda p: p.setting,
    )
    xs = [getattr(p, key) for p in curve]
    ys = [p.agreement for p in curve]
    out = []
    for p in points:
        if p.system != "early_exit" or getattr(p, key) is None:
            continue
        x = getattr(p, key)
        out.append(Comparison(int(p.setting), x, p.agreement, _interpolate(xs, ys, x)))
    return out


def comparison_summary(
    points: list[CurvePoint], systems: tuple[str, ...] = ("specee", "specee_mask")
) -> str:
    """One line per curve of ``systems`` and axis: where it sits against fixed early exit."""
    lines = []
    for system in systems:
        for key, axis in (("speedup", "equal speed"), ("avg_layers", "equal layers")):
            found = [c for c in above_early_exit(points, system, key) if c.specee is not None]
            if not any(p.system == system for p in points):
                continue
            if not found:
                lines.append(f"{system} vs early_exit at {axis}: no early-exit point in range")
                continue
            above = [c for c in found if c.above]
            margins = ", ".join(f"E={c.exit_layer} {c.specee - c.early_exit:+.1%}" for c in found)
            verdict = "above" if len(above) == len(found) else "NOT above"
            lines.append(
                f"{system} vs early_exit at {axis}: {verdict} at {len(above)}/{len(found)} "
                f"comparable E ({margins})"
            )
    return "\n".join(lines)


def sweep_threshold_table(points: list[CurvePoint]) -> str:
    """The curve as text, one line per point."""
    lines = [
        f"{'system':<12} {'setting':>8} {'tok/s':>8} {'speedup':>8} {'agreement':>9} "
        f"{'layers':>6} {'predictor':>9}",
        "-" * 65,
    ]
    for p in points:
        setting = f"{_NAMES.get(p.system, 't')}={p.setting:g}"  # E=10, t=0.9, tau=0.8
        layers = f"{p.avg_layers:.2f}" if p.avg_layers is not None else "-"
        share = f"{p.predictor_share:.1%}" if p.predictor_share is not None else "-"
        lines.append(
            f"{p.system:<12} {setting:>8} {p.tokens_per_second:>8.1f} {p.speedup:>7.2f}x "
            f"{p.agreement:>9.1%} {layers:>6} {share:>9}"
        )
    return "\n".join(lines)


_NAMES = {"early_exit": "E", "m2r2_exit": "tau"}  # the setting's symbol (t: SpecEE's)
_STYLES = {"specee": "^-", "specee_mask": "o-", "m2r2_exit": "D-", "early_exit": "s--"}


def write_curve_plot(path: str | Path, points: list[CurvePoint]) -> None:
    """Agreement against speedup over leapfx_autoregressive, one line per system."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # Left: against measured speed. Right: against decoder layers per token, which does not
    # move with the machine's load (the speed of an eager CPU decode follows it closely).
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    for ax, key, xlabel in (
        (axes[0], "speedup", "speedup over leapfx_autoregressive (tokens/s ratio)"),
        (axes[1], "avg_layers", "decoder layers per token (teacher-forced)"),
    ):
        for system in dict.fromkeys(p.system for p in points):
            style = _STYLES.get(system, "^-")
            pts = [p for p in points if p.system == system and getattr(p, key) is not None]
            pts.sort(key=lambda p: getattr(p, key))
            if not pts:
                continue
            xs = [getattr(p, key) for p in pts]
            ax.plot(xs, [p.agreement for p in pts], style, label=system)
            for p, x in zip(pts, xs, strict=True):
                label = f"E={int(p.setting)}" if system == "early_exit" else f"{p.setting:g}"
                ax.annotate(label, (x, p.agreement), fontsize=7, xytext=(3, 3),
                            textcoords="offset points")  # fmt: skip
        ax.set_xlabel(xlabel)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("teacher-forced agreement with greedy")
    axes[0].legend()
    fig.tight_layout()
    write_figure(path, fig)
