"""The agreement-vs-speed curve of M2R2's ARLA exit against fixed early exit.

A lossy recipe trades agreement with the full model for speed; one setting is one point. This
sweeps ``m2r2_exit``'s threshold tau (M2R2 Fig. 7) and ``early_exit``'s fixed exit layer on
the same prompts, measured as SpecEE's sweep measures (``specee_sweep.measure_points``: each
point's tokens/s of free-running greedy decoding over ``leapfx_autoregressive``'s timed right
before it, the teacher-forced agreement with the full model's greedy tokens and the decoder
layers per token), with the same verdict (``specee_sweep.comparison_summary``: the curve's
agreement at each early-exit point's speed, and at its layers).
``leapfx bench --recipe m2r2 --sweep-threshold --sweep-thresholds 0.5,0.7,0.9 [--plot curve.png]``.
"""

from __future__ import annotations

from functools import partial

import torch

from .. import rewrite
from .specee_sweep import CurvePoint, measure_points

SYSTEM = "m2r2_exit"


def exit_curve(
    model,
    prompts: list[torch.Tensor],
    greedy_outputs: list[torch.Tensor],
    *,
    thresholds: list[float],
    exit_layers: list[int],
    parts: str | None,
    exit_gates: tuple[int, ...] | None = None,
    max_new_tokens: int,
    repeats: int = 1,
    cpu_kernels: bool = False,
) -> list[CurvePoint]:
    """Curve points of ``m2r2_exit`` per threshold and ``early_exit`` per exit layer."""
    apply = partial(rewrite.apply, model)
    exit_ = partial(apply, SYSTEM, parts=parts, exit_gates=exit_gates)
    systems = [(SYSTEM, t, partial(exit_, threshold=t)) for t in thresholds]
    systems += [("early_exit", e, partial(apply, "early_exit", exit_layer=e)) for e in exit_layers]
    return measure_points(
        model, prompts, greedy_outputs, systems, max_new_tokens=max_new_tokens,
        repeats=repeats, cpu_kernels=cpu_kernels,
    )  # fmt: skip
