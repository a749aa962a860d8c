"""Calibrating ``swift``'s skip set on a model: ``SpeculativeModel.calibrate`` from an HF model.

The search and its measuring live with the runtime (``leapfx.runtime.swift``:
``fastest_skip_set`` over ``measured_speed``); ``SpeculativeModel.calibrate`` runs them on a
swift model and keeps the set (``save_parts`` stores it). This is the bench's one-call form:
apply ``swift``, calibrate, return the set and its speed over autoregressive decoding. A greedy
forward search takes O(L^2) decodes: on a 30-layer model, ~400 short ones (keep the prompts
few and short).

    >>> skip, speed = calibrate_skip_set(hf_model, prompts, max_new_tokens=32)
    >>> sm = rewrite.apply(hf_model, "swift", skip_layers=skip)
"""

from __future__ import annotations

import torch
from torch import nn

from .. import rewrite


def calibrate_skip_set(
    model: nn.Module, prompts: list[torch.Tensor], *, max_new_tokens: int = 32,
    num_speculations: int = 4, max_skip: int | None = None,
) -> tuple[tuple[int, ...], float]:  # fmt: skip
    """The skip set whose ``swift`` decodes measure fastest (greedy forward search) and its
    speed over autoregressive decoding (1.0 and () where no set beats it)."""
    sm = rewrite.apply(model, "swift", num_speculations=num_speculations)
    result = sm.calibrate(prompts, max_new_tokens=max_new_tokens, max_skip=max_skip,
                          progress=False)  # fmt: skip
    if result.speedup <= 1.0:
        return (), 1.0
    return result.skip_layers, result.speedup
