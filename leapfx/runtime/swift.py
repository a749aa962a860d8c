"""Layer-skip self-speculation (SWIFT, arXiv 2410.06916; Draft & Verify, arXiv 2309.08168).

Stages (``leapfx.passes.skip_layers.swift_stages``): ``full`` and ``draft``, the same model with
a set of its layers skipped (no training: the skipped layers' inputs flow past them).

A round, with the newest token x at position p (not yet in the cache)::

    draft:  y_1..y_d from x, y_1, ..: ``draft`` calls at p..p+d-1; the kept layers write
            their keys there, the skipped ones nothing.
    verify: crop the cache to p (every layer), then one ``full`` call over [x, y_1..y_d] at
            p..p+d, which writes every layer's keys for those positions -> d + 1 targets.
    accept: ``rounds.speculative_loop``'s acceptance and crop.

Lossless for any skip set. Which set pays is the question SWIFT's search answers:
``search_skip_set`` grows the set one layer at a time, keeping the layer whose removal
measures fastest, while the measured speed improves. Host syncs: one a round.

Calibration (``SpeculativeModel.calibrate``, offline): :func:`fastest_skip_set` runs that
search over a measured score, :func:`measured_speed` (tokens/s of real greedy decodes of the
calibration prompts), and :class:`SwiftParts` saves the set it found with the parts
(``parts.swift``).

On the fly (``search="online"``, SWIFT sec. 4.1): ``skip_search.OnlineSkipSearch`` chooses
each round's set during decoding, from the trials it measures, and ends on the fastest (or
on none: plain steps) (:class:`OnlineSkipDrafter`). The set is a runtime choice, so its
draft stage is cut when first tried (:class:`SkipStages`: ``passes.skip_layers.skip_stage``
of the ``full`` executor the runner holds, eager or the CPU kernels' copy, sharing its
modules) and kept for the model's later rounds. A small cache of cut stages rather than one
executor that skips layers at run time: a cut stage is the same code the fixed-set recipe
runs (the same cost, which is what the search measures), cutting one takes milliseconds
once a set, and an executor that decides per layer at run time would need a graph with
branches that no other stage has.
"""

from __future__ import annotations

import copy
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx

from ..parts.io import host_signature
from ..parts.swift import write_skip_set
from ..passes.skip_layers import skip_stage
from .metrics import DecodeMetrics
from .rounds import run_drafter
from .runner import StageRunner
from .sampling import SamplingParams
from .schedules import (
    DecodeRequest,
    Draft,
    Drafter,
    FirstDrafter,
    draft_steps,
    no_draft,
)
from .skip_search import OnlineSkipSearch

log = logging.getLogger(__name__)


def draft_skip(
    runner: StageRunner, x: torch.Tensor, start: int, d: int, request: DecodeRequest
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """d drafts from token x [1, 1] at ``start`` with the ``draft`` stage (``draft_steps``):
    drafts [1, d] and, when sampling, their distributions q [1, d, V]."""

    def step(token: torch.Tensor, i: int) -> torch.Tensor:
        return runner.chunk("draft", token, start + i)["logits"][:, -1]  # [1, V]

    tokens, q, _ = draft_steps(step, x, d, request)
    return tokens, q


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


class SkipStages:
    """Draft stages cut at decode time, one a skip set (the online search's candidates), from
    the ``full`` executor the runner holds; the ``size`` most recently used are kept, and all
    dropped when the model's ``full`` executor changes (``use_cpu_kernels``)."""

    def __init__(self, size: int = 8) -> None:
        self.size = size
        self._full: Any = None
        self._stages: OrderedDict[tuple[int, ...], fx.GraphModule] = OrderedDict()

    def runner(self, runner: StageRunner, skip: tuple[int, ...]) -> StageRunner:
        """``runner`` with ``draft`` the stage that skips ``skip`` (the same cache, clock and
        masks; the other stages unchanged)."""
        full = runner.stages["full"]
        if full is not self._full:
            if not isinstance(full, fx.GraphModule):
                raise ValueError(
                    f"search: 'online' cuts draft stages from the eager 'full' stage; this model's "
                    f"is a {type(full).__name__} (allowed: the eager backend, with or without "
                    "cpu_kernels)"
                )
            self._full, self._stages = full, OrderedDict()
        stage = self._stages.get(skip)
        if stage is None:
            stage = skip_stage(full, skip)
            free = getattr(full, "mask_free", None)
            if free is not None:  # the kernels' rule: the draft's layers are full's, fewer
                stage.mask_free = free
            self._stages[skip] = stage
            if len(self._stages) > self.size:
                self._stages.popitem(last=False)
        self._stages.move_to_end(skip)
        view = copy.copy(runner)  # shares the cache, positions and stage timings
        view.stages = {**runner.stages, "draft": stage}
        return view


class OnlineSkipDrafter(SkipDrafter):
    """Drafts each round with the set the online search asks for (``search.current``; none:
    a plain step, counted "declined") and tells it how the round went: drafts kept (from
    ``accepted``) and wall time, from this ``propose`` to the next (the verify, acceptance
    and host sync included, as a user waits for them). A round another drafter ran in between
    (``lookup=True``, ``adaptive=True``) leaves the time of this drafter's last round unknown
    (its acceptance still counts).

    ``exploring`` while the search runs (the adaptive drafter then gives it every round at
    full length: its trials are measurements), ``idle`` once it has found that no set pays
    (the adaptive drafter then leaves it out)."""

    def __init__(self, search: OnlineSkipSearch, stages: SkipStages) -> None:
        self.search, self.stages = search, stages
        self._round: tuple[tuple[int, ...], int, float] | None = None  # skip, drafted, start
        self._kept: int | None = None  # that round's accepted drafts (``accepted``)
        self._between = False  # another round's ``accepted`` came after it

    @property
    def exploring(self) -> bool:
        return self.search.exploring

    @property
    def idle(self) -> bool:
        return not self.search.exploring and not self.search.chosen

    def propose(self, runner, x, start, d, request, out) -> Draft:
        now = time.perf_counter()
        self.finish(now)
        if d == 0:
            return no_draft(x)
        skip = self.search.current
        if not skip:  # the baseline's plain steps, or no set pays
            self._round = (skip, 0, now)
            return no_draft(x, "declined")
        drafts, q = draft_skip(self.stages.runner(runner, skip), x, start, d, request)
        runner.cache.crop(start)  # the kept layers' draft keys: verify rewrites every layer's
        self._round = (skip, drafts.shape[1], now)
        return Draft(drafts, q, self.name)

    def accepted(self, runner, start, k):
        if self._round is None:
            return
        if self._kept is None:
            self._kept = k
        else:
            self._between = True

    def finish(self, now: float) -> None:
        """Tell the search how this drafter's last round went, ``now`` its end: at the next
        ``propose``, and at the end of the decode (every round is observed, the last one
        too, so that none is left out for what came after it)."""
        if self._round is not None and self._kept is not None:
            skip, drafted, began = self._round
            seconds = None if self._between else now - began
            self.search.observe(skip, drafted, self._kept, seconds)
        self._round, self._kept, self._between = None, None, False


def swift(
    runner: StageRunner,
    prompt: torch.Tensor,
    request: DecodeRequest,
    metrics: DecodeMetrics,
    num_speculations: int,
    first: FirstDrafter | None = None,
    search: OnlineSkipSearch | None = None,
    stages: SkipStages | None = None,
) -> list[int]:
    """Draft with the layer-skipped model, verify with the full one. ``first``: a drafter
    tried before the layer-skipped one each round (``lookup=True``; nothing but the cache
    outlives a swift round, and its verify is the same full call). ``search``: the model's
    online skip-set search (``search="online"``), whose state the decode goes on from and
    whose account lands in ``metrics.skip_search``; ``stages``: its cut draft stages."""
    metrics.num_speculations = num_speculations
    if search is None:
        return run_drafter(runner, prompt, request, metrics, num_speculations, SkipDrafter(), first)
    search.bind(len(runner.layout.kinds))
    drafter = OnlineSkipDrafter(search, stages if stages is not None else SkipStages())
    tokens = run_drafter(runner, prompt, request, metrics, num_speculations, drafter, first)
    drafter.finish(time.perf_counter())
    metrics.skip_search = search.as_dict()
    return tokens


def search_skip_set(
    evaluate: Callable[[tuple[int, ...]], float], num_layers: int, max_skip: int | None = None
) -> tuple[tuple[int, ...], float]:
    """Greedy forward search over skip sets (layers 1..L-1): from the empty set, add the layer
    whose set ``evaluate`` (measured tokens/s, higher is better) scores best, while that beats
    the current set; returns (the set, its score). ``evaluate(())`` is the baseline (no
    drafting). At most ``max_skip`` layers (default L - 2). O(L^2) evaluations.

    >>> search_skip_set(lambda s: -abs(len(s) - 2) - sum(s) / 10, 5)
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
    (``SpeculativeModel.save_parts``), with the calibration that chose it if any; with
    ``search="online"``, the set the search chose where it chose one (else the starting set)."""

    def fit(self, model: Any, data: Any, **options: Any) -> Any:
        raise ValueError(
            "fit: recipe 'swift' trains nothing (its draft is the model without skip_layers); "
            "allowed: sm.calibrate(prompts), which searches the fastest skip set, then "
            "sm.save_parts(dir) to keep it"
        )

    def save(self, model: Any, path: Any) -> Any:
        o = model.options
        skip = o.skip_layers
        search = model.skip_search
        if search is not None and search.chosen:
            skip = search.chosen  # the online search's choice, to draft with it from the start
        calibration = model.calibration
        if calibration is not None and calibration.skip_layers != skip:
            calibration = None  # it measured another set
        return write_skip_set(
            path,
            options={"skip_layers": list(skip), "num_speculations": o.num_speculations},
            host=host_signature(model.config),
            calibration=None if calibration is None else calibration.as_dict(),
        )
