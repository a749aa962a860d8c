"""Teacher-forced agreement of a lossy recipe with the full model's greedy decoding.

A free-running comparison of a lossy recipe's output with greedy's says little after the first
differing token: from there on the two continue different texts. Teacher forcing asks instead,
position by position, whether the recipe would have emitted greedy's token: the recipe is fed the
full model's greedy tokens (``generate(..., teacher_tokens=...)``) and decides everything else
(exit layers, what its cache holds) as it would on its own; ``agreement`` is the share of
positions where its own choice equals greedy's. SpecEE's and M2R2's accuracy claims are of this
kind (per-token agreement with the dense model at the same prefix).

    >>> from leapfx.bench.agreement import teacher_forced_agreement
    >>> ee = rewrite.apply(hf_model, "early_exit", exit_layer=6)
    >>> greedy = [hf_model.generate(p, max_new_tokens=64, do_sample=False) for p in prompts]
    >>> result = teacher_forced_agreement(ee, prompts, greedy)
    >>> result.agreement, result.avg_layers
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Agreement:
    """Teacher-forced agreement over a set of prompts."""

    agreed: int  # positions whose own token equalled greedy's
    positions: int  # positions decided
    avg_layers: float | None  # decoder layers per token under teacher forcing (None: unrecorded)

    @property
    def agreement(self) -> float:
        return self.agreed / self.positions if self.positions else 0.0


def teacher_forced_agreement(
    sm, prompts: list[torch.Tensor], greedy_outputs: list[torch.Tensor]
) -> Agreement:
    """Agreement of the lossy SpeculativeModel ``sm`` with ``greedy_outputs`` (each [1, n + m]:
    the prompt and the full model's greedy continuation, as HF ``generate`` returns it)."""
    if len(prompts) != len(greedy_outputs):
        raise ValueError(
            f"greedy_outputs: {len(greedy_outputs)} outputs for {len(prompts)} prompts; "
            "allowed: one per prompt"
        )
    agreed = positions = 0
    layers: list[int] = []
    for prompt, ref in zip(prompts, greedy_outputs, strict=True):
        teacher = ref[0, prompt.shape[1] :]
        if teacher.numel() == 0:
            continue
        sm.generate(prompt, teacher_tokens=teacher, max_new_tokens=teacher.numel())
        m = sm.last_metrics
        agreed += m.teacher_agreed
        positions += m.teacher_positions
        layers.extend(m.layers_per_token)
    return Agreement(agreed, positions, sum(layers) / len(layers) if layers else None)
