"""The agreement-vs-speed curve of dynamic early exit against fixed early exit.

A lossy recipe trades agreement with the full model for speed; one setting is one point. This
sweeps ``m2r2_exit``'s threshold tau (M2R2 Fig. 7) and ``early_exit``'s fixed exit layer on
the same prompts: each point is the tokens/s of free-running greedy decoding over
``leapfx_autoregressive``'s (same prompts, same pass), the teacher-forced agreement with the
full model's greedy tokens (``leapfx.bench.agreement``) and the decoder layers per token.
``leapfx bench --recipe m2r2 --sweep-threshold --sweep-thresholds 0.5,0.7,0.9 [--plot curve.png]``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from .. import rewrite
from .agreement import teacher_forced_agreement


@dataclass(frozen=True)
class CurvePoint:
    system: str  # "m2r2_exit" or "early_exit"
    setting: str  # "tau=0.7" or "E=6"
    speedup: float  # tokens/s over leapfx_autoregressive's
    agreement: float
    avg_layers: float | None


def _tokens_per_second(sm, prompts, max_new_tokens: int) -> float:
    tokens, start = 0, time.perf_counter()
    for p in prompts:
        out = sm.generate(p, max_new_tokens=max_new_tokens)
        tokens += out.shape[1] - p.shape[1]
    return tokens / (time.perf_counter() - start)


def exit_curve(
    model,
    prompts: list[torch.Tensor],
    greedy_outputs: list[torch.Tensor],
    *,
    thresholds: list[float],
    exit_layers: list[int],
    parts: str | None,
    max_new_tokens: int,
    cpu_kernels: bool = False,
) -> list[CurvePoint]:
    """Curve points of ``m2r2_exit`` per threshold and ``early_exit`` per exit layer."""

    def prepared(sm):
        return sm.use_cpu_kernels() if cpu_kernels else sm

    base = prepared(rewrite.apply(model, "autoregressive"))
    _tokens_per_second(base, prompts[:1], 8)  # warm-up
    ar = _tokens_per_second(base, prompts, max_new_tokens)
    systems = [("m2r2_exit", f"tau={t:g}", {"threshold": t, "parts": parts}) for t in thresholds]
    systems += [("early_exit", f"E={e}", {"exit_layer": e}) for e in exit_layers]
    points = []
    for name, setting, options in systems:
        sm = prepared(rewrite.apply(model, name, **options))
        speed = _tokens_per_second(sm, prompts, max_new_tokens)
        agree = teacher_forced_agreement(sm, prompts, greedy_outputs)
        points.append(CurvePoint(name, setting, speed / ar, agree.agreement, agree.avg_layers))
    return points


def curve_table(points: list[CurvePoint]) -> str:
    lines = ["system      setting   vs autoregressive  agreement  layers/token"]
    for p in points:
        layers = "-" if p.avg_layers is None else f"{p.avg_layers:.2f}"
        lines.append(
            f"{p.system:<11} {p.setting:<9} {p.speedup:>8.2f}x          {p.agreement:>7.1%}"
            f"    {layers}"
        )
    return "\n".join(lines)


def write_curve_plot(path, points: list[CurvePoint]) -> None:
    """Agreement against speedup, one line per system (PNG), written atomically."""

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from .report import write_figure

    fig, ax = plt.subplots(figsize=(6, 4))
    for name in dict.fromkeys(p.system for p in points):
        ps = sorted((p for p in points if p.system == name), key=lambda p: p.speedup)
        ax.plot([p.speedup for p in ps], [p.agreement for p in ps], "o-", label=name)
        for p in ps:
            ax.annotate(p.setting, (p.speedup, p.agreement), fontsize=7)
    ax.set_xlabel("speed over leapfx_autoregressive")
    ax.set_ylabel("teacher-forced agreement with greedy")
    ax.legend()
    fig.tight_layout()
    write_figure(path, fig)
