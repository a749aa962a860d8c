"""Choosing E and d: the speedup formula, ``--sweep`` over a grid, and ``--auto`` calibration.

The standard speculative-decoding estimate (Leviathan et al. 2023, eq. for walltime): with a
per-token acceptance probability alpha, d draft tokens per round and a draft step costing c times
a target step, the expected speedup over autoregressive decoding is

    (1 - alpha^(d+1)) / ((1 - alpha) (d c + 1)).

alpha is measured as accepted / (accepted + rejected drafts) (the geometric MLE; drafts after a
rejection are never tested), and c as the measured time of one draft-stage call over the time
per token of the leapfx autoregressive schedule in the same run. The prediction is therefore
relative to ``leapfx_autoregressive``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .. import rewrite
from .report import progress_bar


def predicted_speedup(alpha: float, d: int, c: float) -> float:
    """(1 - alpha^(d+1)) / ((1 - alpha)(d c + 1)); alpha = 1 gives (d + 1) / (d c + 1)."""
    tokens = d + 1 if alpha >= 1.0 else (1 - alpha ** (d + 1)) / (1 - alpha)
    return tokens / (d * c + 1)


@dataclass
class Calibration:
    exit_layer: int
    num_speculations: int
    alpha: float
    acceptance_rate: float
    c: float
    tokens_per_second: float
    predicted: float  # vs leapfx_autoregressive
    measured: float | None = None  # vs leapfx_autoregressive, when measured


def _run(sm, prompts, max_new_tokens) -> tuple[float, list]:
    metrics, seconds, new = [], 0.0, 0
    for p in prompts:
        out = sm.generate(p, max_new_tokens=max_new_tokens)
        metrics.append(sm.last_metrics)
        seconds += sm.last_metrics.seconds
        new += out.shape[1] - p.shape[1]
    return new / seconds, metrics


def autoregressive_steps(metrics: list) -> int:
    """Decode steps of autoregressive runs: full-stage calls less each run's prefill (its
    first full call, timed apart as "prefill" in ``stage_seconds``)."""
    return sum(m.full_calls for m in metrics) - len(metrics)


def autoregressive_seconds(
    model, prompts, max_new_tokens, repeats=1, cpu_kernels: bool = False
) -> tuple[float, float]:
    """Of the fastest of ``repeats`` runs: (seconds per new token, seconds per decode step).

    A token's time includes the prompts' prefills (what tokens/s ratios compare); a decode
    step's is the full stage's time per step without them (what a draft call's c is over).
    """
    ar = rewrite.apply(model, "autoregressive", cpu_kernels=cpu_kernels)
    tps, metrics = max((_run(ar, prompts, max_new_tokens) for _ in range(repeats)),
                       key=lambda r: r[0])  # fmt: skip
    steps = autoregressive_steps(metrics)
    step_s = sum(m.stage_seconds.get("full", 0.0) for m in metrics) / steps if steps else 0.0
    return 1.0 / tps, step_s or 1.0 / tps


def calibrate(
    model: nn.Module,
    prompts: list[torch.Tensor],
    exit_layers: list[int],
    speculations: list[int],
    *,
    max_new_tokens: int,
    repeats: int = 1,
    progress: bool = True,
    cpu_kernels: bool = False,
) -> list[Calibration]:
    """Measure alpha, c and tokens/s of layerskip for each (E, d) of the grid (eager stages;
    ``cpu_kernels``: with leapfx's CPU kernels, see ``SpeculativeModel.use_cpu_kernels``)."""
    ar_tok, ar_step = autoregressive_seconds(
        model, prompts, max_new_tokens, repeats, cpu_kernels=cpu_kernels
    )
    grid = [(e, d) for e in exit_layers for d in speculations]
    out = []
    for e, d in progress_bar(grid, desc="sweep", unit="cfg", enabled=progress):
        sm = rewrite.apply(
            model, "layerskip", exit_layer=e, num_speculations=d, cpu_kernels=cpu_kernels
        )
        runs = [_run(sm, prompts, max_new_tokens) for _ in range(repeats)]
        tps, metrics = max(runs, key=lambda r: r[0])
        accepted = sum(m.accepted_drafts for m in metrics)
        drafted = sum(m.drafted_tokens for m in metrics)
        rejected = sum(m.rejections for m in metrics)
        alpha = accepted / (accepted + rejected) if accepted + rejected else 0.0
        draft_s = sum(m.stage_seconds.get("draft", 0.0) for m in metrics)
        calls = sum(m.draft_calls for m in metrics)
        c = (draft_s / calls) / ar_step if calls else 1.0
        out.append(
            Calibration(
                exit_layer=e, num_speculations=d, alpha=alpha,
                acceptance_rate=accepted / drafted if drafted else 0.0, c=c,
                tokens_per_second=tps, predicted=predicted_speedup(alpha, d, c),
                measured=tps * ar_tok,
            )
        )  # fmt: skip
    return out


def choose(calibrations: list[Calibration]) -> Calibration:
    """The (E, d) with the best measured speedup over ``leapfx_autoregressive`` (``--auto``).

    Measured, not predicted: the formula assumes a verify pass costs one autoregressive step,
    which on a CPU it does not (docs/benchmarks.md), and a short calibration's alpha is noisy, so
    the predicted best was often a poor setting in practice (on the reference model it picked
    E = 2, d = 6, which then ran 0.94x). Calibrations without a measurement fall back to the
    prediction.
    """
    return max(calibrations, key=lambda c: c.measured if c.measured is not None else c.predicted)


def pays(calibration: Calibration) -> bool:
    """Whether ``calibration``'s setting decoded faster than ``leapfx_autoregressive`` (its
    measured speedup, else the predicted one, above 1): ``--auto`` says when no setting did,
    since on such a model (no early exit agrees with the last layer) speculation only costs."""
    speedup = calibration.measured if calibration.measured is not None else calibration.predicted
    return speedup > 1.0


def sweep_table(rows: list[Calibration]) -> str:
    head = f"{'E':>3} {'d':>3} {'alpha':>6} {'accept':>6} {'c':>6} {'tok/s':>8} "
    head += f"{'measured':>9} {'predicted':>9} {'ratio':>6}"
    lines = [head, "-" * len(head)]
    for r in rows:
        m = r.measured if r.measured is not None else float("nan")
        lines.append(
            f"{r.exit_layer:>3} {r.num_speculations:>3} {r.alpha:>6.3f} {r.acceptance_rate:>6.3f}"
            f" {r.c:>6.3f} {r.tokens_per_second:>8.1f} {m:>8.2f}x {r.predicted:>8.2f}x"
            f" {m / r.predicted:>6.2f}"
        )
    return "\n".join(lines)
