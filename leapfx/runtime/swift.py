"""Layer-skip self-speculation (SWIFT, arXiv 2410.06916; Draft & Verify, arXiv 2309.08168).

Stages (``leapfx.passes.skip_layers.swift_stages``): ``full`` and ``draft``, the same model with
a set of its layers skipped (no training: the skipped layers' inputs flow past them).

A round, with the newest token x at position p (not yet in the cache)::

    draft:  y_1..y_d from x, y_1, ..: ``draft`` calls at p..p+d-1; the kept layers write
            their keys there, the skipped ones nothing.
    verify: crop the cache to p (every layer), then one ``full`` call over [x, y_1..y_d] at
            p..p+d, which writes every layer's keys for those positions -> d + 1 targets.
    accept: ``schedules.speculative_loop``'s acceptance and crop.

Lossless for any skip set. Which set pays is the question SWIFT's search answers:
``search_skip_set`` grows the set one layer at a time, keeping the layer whose removal
measures fastest, while the measured speed improves. Host syncs: one a round.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .metrics import DecodeMetrics
from .runner import StageRunner
from .sampling import probs
from .schedules import DecodeRequest, FirstDrafter, speculative_loop


def draft_skip(
    runner: StageRunner, x: torch.Tensor, start: int, d: int, request: DecodeRequest
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """d drafts from token x [1, 1] at ``start`` with the ``draft`` stage: drafts [1, d] and,
    when sampling, their distributions q [1, d, V]."""
    tokens, qs = [], []
    token = x
    for i in range(d):
        logits = runner.chunk("draft", token, start + i)["logits"]  # [1, 1, V]
        if request.sampling.do_sample:
            q = probs(logits[:, -1].float(), request.sampling)  # [1, V]
            token = torch.multinomial(q, 1, generator=request.generator)
            qs.append(q)
        else:
            token = logits[:, -1].argmax(dim=-1, keepdim=True)  # [1, 1]
        tokens.append(token)
    return torch.cat(tokens, dim=1), (torch.stack(qs, dim=1) if qs else None)


def swift(
    runner: StageRunner,
    prompt: torch.Tensor,
    request: DecodeRequest,
    metrics: DecodeMetrics,
    num_speculations: int,
    first: FirstDrafter | None = None,
) -> list[int]:
    """Draft with the layer-skipped model, verify with the full one. ``first``: a drafter
    tried before the layer-skipped one each round (``lookup=True``; nothing but the cache
    outlives a swift round, and its verify is the same full call)."""
    metrics.num_speculations = num_speculations

    def round_(runner, x, pos, d, request):
        drafts, q = draft_skip(runner, x, pos, d, request)
        metrics.record_round("swift")
        runner.cache.crop(pos)  # the kept layers' draft keys: verify rewrites every layer's
        return drafts, q, runner.full(torch.cat([x, drafts], dim=1), pos, key="verify")

    return speculative_loop(runner, prompt, request, metrics, num_speculations, round_, first=first)


def search_skip_set(
    evaluate: Callable[[tuple[int, ...]], float], num_layers: int, max_skip: int | None = None
) -> tuple[tuple[int, ...], float]:
    """Greedy forward search over skip sets (layers 1..L-1): from the empty set, add the layer
    whose set ``evaluate`` (measured tokens/s, higher is better) scores best, while that beats
    the current set; returns (the set, its score). ``evaluate(())`` is the baseline (no
    drafting). At most ``max_skip`` layers (default L - 2). O(L^2) evaluations.

    >>> search_skip_set(lambda s: -abs(len(s) - 2) - 0.1 * sum(s), 5)
    ((1, 2), -0.3)
    """
    max_skip = num_layers - 2 if max_skip is None else max_skip
    best, score = (), evaluate(())
    while len(best) < max_skip:
        options = [tuple(sorted((*best, i))) for i in range(1, num_layers) if i not in best]
        scored = [(evaluate(s), s) for s in options]
        top, top_set = max(scored, key=lambda t: t[0])
        if top <= score:
            break
        best, score = top_set, top
    return best, score
