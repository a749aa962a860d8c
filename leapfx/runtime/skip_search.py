"""SWIFT's on-the-fly skip-set search (arXiv 2410.06916, sec. 4.1), on measured rounds.

SWIFT spends the first rounds of decoding on finding which layers the draft skips: it proposes
candidate sets (random sets first, then sets a Bayesian optimiser suggests), scores each on the
text the model has produced, keeps the best, and then drafts with it. Here each candidate is
scored by what a user waits for, real rounds: a trial drafts ``rounds`` rounds of d drafts with
the set (after one untimed round: its draft stage is cut and called for the first time) and
measures their acceptance and wall time; the empty set is a trial too, of plain steps, the
baseline every set must beat. The score is tokens per second, (emitted tokens) / (seconds)
over the trial's timed rounds.

Candidates, in order:

1. the empty set (the baseline), then the recipe's starting set (``skip_layers``: the user's,
   the parts', or every second layer);
2. ``random_trials`` random sets of spread sizes (half, a third, two thirds of the layers
   1..L-2), SWIFT's random phase;
3. then the set a surrogate's acquisition ranks first (Bayesian optimisation): acceptance is
   modelled as 1 - (the sum of the skipped layers' harms), the harms under a Gaussian prior
   (mean: the pooled harm per skipped layer measured so far) updated by every trial's
   acceptance (Bayesian linear regression), and a round's cost as a line in the kept layers
   fitted to the trials' measured round times. A set's upper-confidence rate is
   E(alpha + ``KAPPA`` sd, d) / C(set) with E(alpha, d) = 1 + alpha + .. + alpha^d; the greedy
   path over layers under that rate gives the proposal (a tried one: its best untried
   neighbour, one layer added, removed or swapped).

The search ends after ``max_trials`` sets, after ``patience`` proposals in a row that did not
beat the best, or as soon as no untried set's upper-confidence rate beats the plain steps by
``MARGIN`` (nothing left worth measuring: on a model where no set pays, that is usually right
after the random phase). It then keeps the set that measured fastest, or none where no set beat
the plain steps by ``MARGIN``: drafting stops. Its state (every trial, the choice) lives with
the applied model, so a later ``generate`` call starts where the last one stopped; ``reset()``
starts over (another kind of text, another machine load). Lossless whatever it tries: every
round is verified by the full model.
"""

from __future__ import annotations

import logging
import math
import random
from dataclasses import dataclass, field
from typing import Any

import torch

from .adaptive import MARGIN, expected_tokens

log = logging.getLogger(__name__)

ROUNDS_PER_TRIAL = 4  # timed rounds a set is measured over
WARMUP_ROUNDS = 1  # untimed first rounds of a set (its stage is cut and called the first time)
RANDOM_TRIALS = 3  # SWIFT's random phase, after the baseline and the starting set
MAX_TRIALS = 16  # sets measured at most, the empty one included
PATIENCE = 4  # surrogate proposals in a row that do not beat the best end the search
KAPPA = 1.0  # the acquisition's optimism: acceptance read at mean + KAPPA standard deviations
RANDOM_SIZES = (0.5, 1 / 3, 2 / 3)  # random sets' sizes, shares of the layers 1..L-2
ROUND_NOISE = 0.25  # variance of one round's acceptance estimate (a Bernoulli's at most)


@dataclass
class SkipTrial:
    """One candidate set's measured rounds (``rounds`` timed; acceptance over all of them)."""

    skip: tuple[int, ...]
    warmup: int = 0  # untimed rounds run so far
    rounds: int = 0  # timed rounds
    seconds: float = 0.0  # their wall time
    tokens: int = 0  # tokens they emitted (accepted drafts + the correction or bonus)
    drafted: int = 0  # over every round of the set, timed or not
    accepted: int = 0
    rejections: int = 0  # rounds that rejected a draft
    confirmed: bool = False  # measured twice as long (a candidate for the choice)

    @property
    def rate(self) -> float:
        """Tokens per second over the timed rounds (0 before any)."""
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def alpha(self) -> float:
        """Per-draft acceptance, the geometric MLE accepted / (accepted + rejections)."""
        n = self.accepted + self.rejections
        return self.accepted / n if n else 1.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "skip_layers": list(self.skip),
            "rounds": self.rounds,
            "tokens_per_second": self.rate,
            "acceptance": self.alpha if self.skip else None,
            "seconds_per_round": self.seconds / self.rounds if self.rounds else None,
        }


@dataclass
class OnlineSkipSearch:
    """The search's state for one applied model (``swift`` with ``search="online"``; it lives
    in the recipe's schedule, ``SpeculativeModel.skip_search``): fed each round by the drafter
    (``observe``), asked which set the next round drafts with (``current``).

    ``start``: the set tried first after the baseline; ``draft_length``: d, the drafts of a
    round that counts (shorter rounds, at the end of a budget, are not measured); ``seed``:
    the random phase's generator."""

    start: tuple[int, ...]
    draft_length: int
    rounds: int = ROUNDS_PER_TRIAL
    max_trials: int = MAX_TRIALS
    random_trials: int = RANDOM_TRIALS
    patience: int = PATIENCE
    seed: int = 0
    num_layers: int | None = None  # bound by the first decode
    trials: dict[tuple[int, ...], SkipTrial] = field(default_factory=dict)
    order: list[tuple[int, ...]] = field(default_factory=list)  # sets in the order tried
    done: bool = False
    chosen: tuple[int, ...] | None = None  # the set drafted with once done; () plain steps
    stale: int = 0  # proposals since the best improved
    measuring: tuple[int, ...] = ()  # the set the current trial drafts with
    confirming: bool = False  # the current trial re-measures the best set before the choice
    _random: random.Random = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._random = random.Random(self.seed)

    def bind(self, num_layers: int) -> None:
        """The host's depth (the first decode tells it); a search is one model's."""
        if self.num_layers is None:
            self.num_layers = num_layers
            self.reset()
        assert self.num_layers == num_layers, "a skip-set search serves one model"

    def reset(self) -> None:
        """Forget every trial and search again from the baseline."""
        self.trials, self.order = {}, []
        self.done, self.chosen, self.stale, self.confirming = False, None, 0, False
        self._random = random.Random(self.seed)
        self._next(())

    @property
    def current(self) -> tuple[int, ...]:
        """The set the next round drafts with (() : a plain step)."""
        return self.chosen if self.done else self.measuring

    @property
    def exploring(self) -> bool:
        return not self.done

    def observe(self, skip: tuple[int, ...], drafted: int, accepted: int, seconds: float | None):
        """A round with set ``skip`` drafted ``drafted`` tokens and kept ``accepted``, in
        ``seconds`` (None: not timed, another drafter's round came between)."""
        trial = self.trials.get(skip)
        if self.done or trial is None or skip != self.measuring:
            return
        if skip and drafted != self.draft_length:
            return  # a short round (the budget's end): another round's cost
        if skip:
            trial.drafted += drafted
            trial.accepted += accepted
            trial.rejections += int(accepted < drafted)
        if trial.warmup < WARMUP_ROUNDS:
            trial.warmup += 1
            return
        if seconds is None:
            return
        trial.rounds += 1
        trial.seconds += seconds
        trial.tokens += accepted + 1
        if trial.rounds >= self.rounds * (2 if self.confirming else 1):
            trial.confirmed = self.confirming
            self._advance()

    # -- choosing the next set ----------------------------------------------------------------

    def _next(self, skip: tuple[int, ...]) -> None:
        self.trials[skip] = SkipTrial(skip)
        self.order.append(skip)
        self.measuring = skip

    @property
    def baseline(self) -> float:
        """Plain steps' tokens per second."""
        return self.trials[()].rate

    def best(self) -> SkipTrial | None:
        """The measured drafting set with the most tokens per second (None before any)."""
        measured = [t for s, t in self.trials.items() if s and t.rounds >= self.rounds]
        return max(measured, key=lambda t: t.rate, default=None)

    def _advance(self) -> None:
        """The current trial is complete: pick the next set, or end the search."""
        if self.confirming:
            self._confirm_or_finish()
            return
        tried = len(self.order)
        last = self.trials[self.order[-1]]
        best = self.best()
        if tried > 2 + self.random_trials:  # a proposal: did it beat the best?
            self.stale = 0 if best is last else self.stale + 1
        proposal = None
        if tried < self.max_trials and self.stale < self.patience:
            if tried == 1:
                proposal = self._fresh(self.start)
            elif tried < 2 + self.random_trials:
                proposal = self._random_set(tried - 2)
            else:
                proposal = self._proposal()
        if proposal is not None:
            self._next(proposal)
        else:
            self._confirm_or_finish()

    def _confirm_or_finish(self) -> None:
        """End on the best set once it is confirmed (or on none where none pays); else measure
        it as long again first: the fastest of several short noisy trials reads fast."""
        best = self.best()
        if self._pays(best) and not best.confirmed:
            self.confirming, self.measuring = True, best.skip
        else:
            self._finish()

    def _fresh(self, skip: tuple[int, ...]) -> tuple[int, ...] | None:
        return skip if skip and skip not in self.trials else None

    def _random_set(self, i: int) -> tuple[int, ...] | None:
        pool = list(range(1, self.num_layers - 1)) or [1]
        size = max(1, min(len(pool), round(RANDOM_SIZES[i % len(RANDOM_SIZES)] * len(pool))))
        for _ in range(8):  # a set not measured yet (small models have few)
            skip = tuple(sorted(self._random.sample(pool, size)))
            if skip not in self.trials:
                return skip
        return self._proposal()

    def _proposal(self) -> tuple[int, ...] | None:
        """The set the surrogate's upper-confidence rate ranks first, untried; None where no
        untried set's beats the plain steps by MARGIN."""
        score = self.surrogate()
        layers = range(1, self.num_layers)
        skip: tuple[int, ...] = ()
        value = -math.inf
        while len(skip) < self.num_layers - 1:  # the greedy path under the surrogate
            grown = [tuple(sorted((*skip, i))) for i in layers if i not in skip]
            top = max(grown, key=score)
            if score(top) <= value:
                break
            skip, value = top, score(top)
        if skip in self.trials:
            near = _neighbours(skip, layers)
            skip = max((s for s in near if s not in self.trials), key=score, default=None)
        if skip is None or score(skip) <= self.baseline * (1 + MARGIN):
            return None
        return skip

    def surrogate(self):
        """``set -> upper-confidence tokens per second`` from the trials so far (see the
        module docstring): Bayesian linear regression of acceptance on the skipped layers,
        and a least-squares line of a round's seconds in the kept layers."""
        L, d = self.num_layers, self.draft_length
        done = [t for s, t in self.trials.items() if s and t.rounds >= self.rounds]
        x = torch.zeros(len(done), L, dtype=torch.float64)
        for row, t in enumerate(done):
            x[row, list(t.skip)] = 1.0
        harm = torch.tensor([1.0 - t.alpha for t in done], dtype=torch.float64)
        count = torch.tensor([t.accepted + t.rejections + 1.0 for t in done], dtype=torch.float64)
        prior = max(float(harm.sum() / x.sum()), 0.02) if done else 0.1  # per skipped layer
        weight = count / ROUND_NOISE
        precision = torch.eye(L, dtype=torch.float64) / prior**2 + x.T @ (weight[:, None] * x)
        cov = torch.linalg.inv(precision)
        mean = cov @ (torch.full((L,), 1.0 / prior, dtype=torch.float64) + x.T @ (weight * harm))
        base = 1.0 / self.baseline if self.baseline > 0 else 1.0  # seconds of a plain step
        kept = [float(L - len(t.skip)) for t in done]
        seconds = [t.seconds / t.rounds for t in done]
        if len(set(kept)) < 2:  # one point: the line through it and (0 kept, a plain step)
            kept, seconds = [0.0, *kept], [base, *seconds]
        slope, intercept = _line(kept, seconds)
        slope, intercept = max(slope, 0.0), max(intercept, 1e-9)

        def score(skip: tuple[int, ...]) -> float:
            v = torch.zeros(L, dtype=torch.float64)
            v[list(skip)] = 1.0
            spread = float(v @ cov @ v) ** 0.5
            alpha = min(max(1.0 - float(v @ mean) + KAPPA * spread, 0.0), 1.0)
            return expected_tokens(alpha, d) / (intercept + slope * (L - len(skip)))

        return score

    def _pays(self, trial: SkipTrial | None) -> bool:
        return trial is not None and trial.rate > self.baseline * (1 + MARGIN)

    def _finish(self) -> None:
        best = self.best()
        self.done, self.confirming = True, False
        self.chosen = best.skip if self._pays(best) else ()
        log.info("%s", self.summary())

    # -- reports ----------------------------------------------------------------------------

    def as_dict(self) -> dict[str, Any]:
        """The search so far: its state, the chosen set, every trial in the order run."""
        return {
            "done": self.done,
            "skip_layers": None if self.chosen is None else list(self.chosen),
            "trials": [self.trials[s].as_dict() for s in self.order],
        }

    def summary(self) -> str:
        """A readable account: the choice, then one line a trial (rate over plain steps)."""
        base = self.trials.get(())
        if self.done:
            head = (
                f"skip-set search: done after {len(self.order)} sets; "
                + (f"drafting with skip_layers={self.chosen}" if self.chosen else
                   "no set beat plain steps: drafting off")
            )  # fmt: skip
        else:
            again = " again" if self.confirming else ""
            head = f"skip-set search: {len(self.order)} sets so far, measuring {self.current}"
            head += again
        lines = [head, "skip_layers  rounds  acceptance  tokens/s  x plain"]
        for s in self.order:
            t = self.trials[s]
            ratio = t.rate / base.rate if base is not None and base.rate > 0 else math.nan
            alpha = f"{t.alpha:.2f}" if s else "-"
            lines.append(f"{s!s:<12} {t.rounds:>6}  {alpha:>10}  {t.rate:>8.1f}  {ratio:>6.2f}x")
        return "\n".join(lines)


def _neighbours(skip: tuple[int, ...], layers) -> list[tuple[int, ...]]:
    """Sets one layer away from ``skip``: one added, one removed, or one swapped."""
    inside, outside = set(skip), [i for i in layers if i not in skip]
    near = [tuple(sorted(inside | {i})) for i in outside]
    near += [tuple(sorted(inside - {i})) for i in skip if len(skip) > 1]
    near += [tuple(sorted((inside - {i}) | {j})) for i in skip for j in outside]
    return near


def _line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """(slope, intercept) of the least-squares line through the points."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx if sxx else 0.0
    return slope, my - slope * mx
