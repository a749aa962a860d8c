"""``leapfx bench --recipe specee --sweep-threshold``: SpecEE's agreement-vs-speed curve.

Each point is one setting of a lossy system decoding the bench prompts greedily: its tokens/s
over ``leapfx_autoregressive`` on the same prompts (timed, best of ``repeats`` passes), its
teacher-forced agreement with the full model's greedy tokens (``leapfx.bench.agreement``) and
its decoder layers per token. SpecEE runs at every threshold of the grid, LayerSkip's fixed early
exit at every E: SpecEE earns its predictors only if its curve lies above fixed early exit at
equal speed (the issue's test). SpecEE runs with both KV policies (``kv_fill`` "mask" and
"next"), which differ most in agreement.

    >>> points = threshold_sweep(model, prompts, greedy, thresholds=[0.5, 0.9], exits=[4, 8])
    >>> print(sweep_threshold_table(points))
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from .. import rewrite
from .agreement import teacher_forced_agreement


@dataclass(frozen=True)
class CurvePoint:
    system: str  # "specee", "specee_next" (kv_fill="next") or "early_exit"
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

    def prepare(sm):
        sm = sm.use_cpu_kernels() if cpu_kernels else sm
        sm.generate(prompts[0], max_new_tokens=4)  # warm-up
        return sm

    base = prepare(rewrite.apply(model, "autoregressive"))
    points = []
    options = dict(specee_options or {})
    options.pop("threshold", None)
    settings = [("specee", t) for t in thresholds] + [("specee_next", t) for t in thresholds]
    settings += [("early_exit", e) for e in exits]
    for system, setting in settings:
        if system == "specee":
            sm = rewrite.apply(model, "specee", threshold=setting, **options)
        elif system == "specee_next":
            sm = rewrite.apply(model, "specee", threshold=setting, kv_fill="next", **options)
        else:
            sm = rewrite.apply(model, "early_exit", exit_layer=setting)
        sm = prepare(sm)
        # The baseline is timed right before each point: on a shared machine the load drifts
        # over a sweep, and a ratio of neighbouring measurements drifts least.
        base_tps, _ = _tokens_per_second(base, prompts, max_new_tokens, repeats)
        tps, share = _tokens_per_second(sm, prompts, max_new_tokens, repeats)
        a = teacher_forced_agreement(sm, prompts, greedy_outputs)
        share = share if system.startswith("specee") else None
        points.append(CurvePoint(system, setting, tps, tps / base_tps, a.agreement,
                                 a.avg_layers, share))  # fmt: skip
    return points


def sweep_threshold_table(points: list[CurvePoint]) -> str:
    """The curve as text, one line per point."""
    lines = [
        f"{'system':<12} {'setting':>8} {'tok/s':>8} {'speedup':>8} {'agreement':>9} "
        f"{'layers':>6} {'predictor':>9}",
        "-" * 65,
    ]
    for p in points:
        setting = f"E={int(p.setting)}" if p.system == "early_exit" else f"t={p.setting:g}"
        layers = f"{p.avg_layers:.2f}" if p.avg_layers is not None else "-"
        share = f"{p.predictor_share:.1%}" if p.predictor_share is not None else "-"
        lines.append(
            f"{p.system:<12} {setting:>8} {p.tokens_per_second:>8.1f} {p.speedup:>7.2f}x "
            f"{p.agreement:>9.1%} {layers:>6} {share:>9}"
        )
    return "\n".join(lines)


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
        for system, style in (("specee", "o-"), ("specee_next", "^-"), ("early_exit", "s--")):
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
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    os.replace(tmp, path)
