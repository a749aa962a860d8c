"""A quantized copy of the model drafts for it (``qspec``; ML-SpecQD, arXiv 2503.13565).

Stages (``leapfx.passes.quantized_draft.qspec_stages``): ``full``, the float model, and
``draft``, the same graph over a copy of its linears as GGUF blocks (Q8_0, Q4_0 or Q4_1,
multiplied by the block kernels), less the layers of a skip set if one is given.

A round, with the newest token x at position p (not yet in the cache)::

    draft:  y_1..y_d from x, y_1, ..: ``draft`` calls at p..p+d-1 over the one KV cache;
            positions < p hold the float model's keys, the drafted ones the copy's.
    verify: crop the cache to p, then one ``full`` call over [x, y_1..y_d] at p..p+d, which
            writes the float model's keys for those positions -> d + 1 targets.
    accept: ``rounds.speculative_loop``'s acceptance (rejection sampling under sampling,
            the draft's q from its own logits) and crop.

The draft round is swift's (``swift.SkipDrafter``: a stage over the shared cache, then a full
verify), so this module only names it. Lossless for any format and skip set: every emitted
token is the float model's (greedy) or distributed as its (sampling).
"""

from __future__ import annotations

import torch

from .metrics import DecodeMetrics
from .rounds import run_drafter
from .runner import StageRunner
from .schedules import DecodeRequest, FirstDrafter
from .swift import SkipDrafter


class QuantizedDrafter(SkipDrafter):
    """Drafts with the ``draft`` stage (the quantized copy); verified by one full call."""

    name = "qspec"


def qspec(
    runner: StageRunner,
    prompt: torch.Tensor,
    request: DecodeRequest,
    metrics: DecodeMetrics,
    num_speculations: int,
    first: FirstDrafter | None = None,
) -> list[int]:
    """Draft with the quantized copy, verify with the float model. ``first``: the adaptive
    policy (``adaptive=True``, the default: how many drafts a round, none included) and prompt
    lookup (``lookup=True``), tried before the copy each round."""
    metrics.num_speculations = num_speculations
    drafter = QuantizedDrafter()
    return run_drafter(runner, prompt, request, metrics, num_speculations, drafter, first)
