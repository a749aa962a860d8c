"""Calibrating ``swift``'s skip set on a model: ``search_skip_set`` over measured tokens/s.

Each candidate set is applied (``rewrite.apply(model, "swift", skip_layers=...)``) and decoded
on the calibration prompts; its score is tokens/s over the whole decode (acceptance from real
drafts, cost from the timed calls together), the empty set's is ``autoregressive``'s. A
greedy forward search takes O(L^2) decodes: on a 30-layer model, ~400 short ones (keep the
prompts few and short). SWIFT's on-the-fly search during decoding is not implemented.

    >>> skip, speed = calibrate_skip_set(hf_model, prompts, max_new_tokens=32)
    >>> sm = rewrite.apply(hf_model, "swift", skip_layers=skip)
"""

from __future__ import annotations

import torch
from torch import nn

from .. import rewrite
from ..runtime.swift import search_skip_set


def measure(
    model: nn.Module, prompts: list[torch.Tensor], skip: tuple[int, ...], *,
    max_new_tokens: int, num_speculations: int = 4,
) -> float:  # fmt: skip
    """Tokens/s of ``swift`` with ``skip`` (autoregressive for the empty set) on ``prompts``,
    after one untimed warm-up decode."""
    if skip:
        sm = rewrite.apply(model, "swift", skip_layers=skip, num_speculations=num_speculations)
    else:
        sm = rewrite.apply(model, "autoregressive")
    sm.generate(prompts[0], max_new_tokens=min(4, max_new_tokens))  # warm-up
    new, seconds = 0, 0.0
    for p in prompts:
        sm.generate(p, max_new_tokens=max_new_tokens)
        new += sm.last_metrics.new_tokens
        seconds += sm.last_metrics.seconds
    return new / seconds


def calibrate_skip_set(
    model: nn.Module, prompts: list[torch.Tensor], *, max_new_tokens: int = 32,
    num_speculations: int = 4, max_skip: int | None = None,
) -> tuple[tuple[int, ...], float]:  # fmt: skip
    """The skip set whose ``swift`` decodes measure fastest (greedy forward search) and its
    speed over autoregressive decoding (1.0 and () where no set beats it)."""
    cache: dict[tuple[int, ...], float] = {}

    def evaluate(skip: tuple[int, ...]) -> float:
        if skip not in cache:
            cache[skip] = measure(model, prompts, skip, max_new_tokens=max_new_tokens,
                                  num_speculations=num_speculations)  # fmt: skip
        return cache[skip]

    skip, speed = search_skip_set(evaluate, model.config.num_hidden_layers, max_skip)
    return skip, speed / cache[()]
