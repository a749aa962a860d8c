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

Calibration (``SpeculativeModel.calibrate``, offline): :func:`fastest_skip_set` runs that
search over a measured score, :func:`measured_speed` (tokens/s of real greedy decodes of the
calibration prompts), and :class:`SwiftParts` saves the set it found with the parts
(``passes.skip_checkpoint``). SWIFT's on-the-fly search during decoding is not implemented.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..passes.adapter_checkpoint import host_signature
from ..passes.skip_checkpoint import write_skip_set
from .metrics import DecodeMetrics
from .runner import StageRunner
from .sampling import SamplingParams, probs
from .schedules import DecodeRequest, Draft, Drafter, FirstDrafter, no_draft, run_drafter

log = logging.getLogger(__name__)


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


class SkipDrafter(Drafter):
    """Drafts with the ``draft`` stage (the layer-skipped model); verified by one full call
    over [x, drafts] after the kept layers' draft keys are dropped (the full call rewrites
    every layer's)."""

    name = "swift"

    def propose(self, runner, x, start, d, request, out) -> Draft:
        if d == 0:
            return no_draft(x)
        drafts, q = draft_skip(runner, x, start, d, request)
        runner.cache.crop(start)  # the kept layers' draft keys: verify rewrites every layer's
        return Draft(drafts, q, self.name)


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
    return run_drafter(runner, prompt, request, metrics, num_speculations, SkipDrafter(), first)


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


@dataclass(frozen=True)
class SkipCalibration:
    """What a skip-set calibration measured (``SpeculativeModel.calibrate``; saved with the
    parts). Speeds are tokens/s over the calibration prompts on the machine it ran on."""

    skip_layers: tuple[int, ...]  # the fastest non-empty set measured
    tokens_per_second: float  # swift drafting without skip_layers
    baseline: float  # autoregressive decoding (the empty set)
    evaluated: int  # sets measured, the empty one included

    @property
    def speedup(self) -> float:
        """Over autoregressive decoding (< 1: swift does not pay on this model and machine)."""
        return self.tokens_per_second / self.baseline

    def as_dict(self) -> dict[str, Any]:
        return {
            "skip_layers": list(self.skip_layers),
            "tokens_per_second": self.tokens_per_second,
            "baseline": self.baseline,
            "speedup": self.speedup,
            "evaluated": self.evaluated,
        }


def measured_speed(
    decode: Callable[[torch.Tensor, DecodeRequest], DecodeMetrics],
    prompts: Sequence[torch.Tensor],
    max_new_tokens: int,
) -> float:
    """Tokens/s of ``decode(prompt, request)`` over ``prompts``: greedy decodes of
    ``max_new_tokens`` tokens each (no EOS stop, so every set decodes the same lengths), timed
    by their metrics, after one untimed warm-up decode of the first prompt."""

    def request(n: int) -> DecodeRequest:
        return DecodeRequest(n, frozenset(), SamplingParams())

    decode(prompts[0], request(min(4, max_new_tokens)))  # warm-up: first-call costs
    new, seconds = 0, 0.0
    for prompt in prompts:
        metrics = decode(prompt, request(max_new_tokens))
        new += metrics.new_tokens
        seconds += metrics.seconds
    return new / seconds


def fastest_skip_set(
    speed: Callable[[tuple[int, ...]], float],
    num_layers: int,
    *,
    max_skip: int | None = None,
    progress: bool = False,
) -> SkipCalibration:
    """``search_skip_set`` over ``speed`` (measured tokens/s of a set; of the empty set,
    autoregressive decoding's), each set measured once; returns the fastest non-empty set
    measured, which is the search's own result wherever that is not empty (the greedy path's
    scores rise, and each set on it beats the rest of its size). Where no set beats plain
    decoding the search stops after the single layers and the fastest of those is returned,
    with a speedup below 1. ``max_skip``: at most this many layers (default L - 2, at least 1).
    """
    max_skip = max(1, num_layers - 2) if max_skip is None else max_skip
    measured: dict[tuple[int, ...], float] = {}
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(desc="swift skip-set search", unit="set")

    def evaluate(skip: tuple[int, ...]) -> float:
        if skip not in measured:
            measured[skip] = speed(skip)
            if bar is not None:
                best = max(measured, key=measured.__getitem__)
                bar.set_postfix(best=str(best), rate=f"{measured[best] / measured[()]:.2f}x")
                bar.update(1)
        return measured[skip]

    try:
        search_skip_set(evaluate, num_layers, max_skip)
    finally:
        if bar is not None:
            bar.close()
    best = max((s for s in measured if s), key=measured.__getitem__)
    result = SkipCalibration(best, measured[best], measured[()], len(measured))
    log.info(
        "swift calibration: skip_layers=%s, %.3gx over autoregressive (%d sets measured)",
        best, result.speedup, result.evaluated,
    )  # fmt: skip
    return result


class SwiftParts:
    """``swift``'s parts (a ``RecipeTraining``): nothing trains; ``save`` writes the skip set
    (``SpeculativeModel.save_parts``), with the calibration that chose it if any."""

    def fit(self, model: Any, data: Any, **options: Any) -> Any:
        raise ValueError(
            "fit: recipe 'swift' trains nothing (its draft is the model without skip_layers); "
            "allowed: sm.calibrate(prompts), which searches the fastest skip set, then "
            "sm.save_parts(dir) to keep it"
        )

    def save(self, model: Any, path: Any) -> Any:
        o = model.options
        calibration = model.calibration
        if calibration is not None and calibration.skip_layers != o.skip_layers:
            calibration = None  # it measured another set
        return write_skip_set(
            path,
            options={"skip_layers": list(o.skip_layers), "num_speculations": o.num_speculations},
            host=host_signature(model.config),
            calibration=None if calibration is None else calibration.as_dict(),
        )
