"""The adaptive drafter (``auto``): per round, how many drafts (none at all included) from live
acceptance and measured round costs, so that speculation never makes decoding slower.

Drafting pays when the tokens a round emits outweigh what its verify pass costs over a plain
step. With a per-draft acceptance probability alpha, a round of d drafts emits

    E(d) = (1 - alpha^(d+1)) / (1 - alpha)    tokens (E(0) = 1: a plain step)

at a cost C(d) (a full-model call over d + 1 tokens, plus the host's work around it), so the
policy takes the d that maximises E(d) / C(d), ``leapfx.bench.sweep.predicted_speedup``'s
expected-tokens-per-cost with the draft's own cost 0 (an n-gram lookup) and the verify cost
measured instead of assumed to be one step. d = 0 wins unless some d beats it by ``MARGIN``:
where drafts are rarely right, or verify passes are dear (a compute-bound model, a busy
machine), the decode falls back to plain steps.

- alpha: the geometric MLE accepted / (accepted + rejections) over the rounds that drafted,
  with counts decayed by ``DECAY`` a drafting round (the live rate: a decode moves between text that
  repeats and text that does not) and a prior of one of each (alpha 0.5 before any round).
- C(d): each round's wall time, from one ``propose`` to the next (the verify call, the
  acceptance and its host sync, the crop, the lookup itself), as a moving average per d, read
  off the least-squares line through those averages (every d, measured or not), or from one
  measured point and ``PRIOR_SLOPE`` (a draft adds this share of a step); each length's first
  round is not counted (first-call costs at a new shape). Wall time is what a
  user waits for, on any backend: a round syncs once, so on a GPU it holds the kernels too.
- Once drafting is off it is probed: after ``PROBE_EVERY`` declined rounds with a match, one
  round drafts a single token, so alpha and C(1) keep being measured (at most 1/PROBE_EVERY of
  the rounds pay a one-token verify).

The drafter is prompt lookup (``leapfx.runtime.lookup``): a round without a match is a plain
step whatever the policy says. Lossless for any choice: only the draft lengths change.
Greedy tokens are identical to the full model's; the lengths (and so the sampled stream of a
seeded generator) depend on timing, the sampled distribution does not.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from .lookup import Drafts, PromptLookup, drafted_loop
from .metrics import DecodeMetrics
from .runner import StageRunner
from .schedules import DecodeRequest

DECAY = 0.9  # per drafting round: the acceptance counts' memory is ~10 rounds
COST_EMA = 0.2  # weight of a new round's time in its length's moving average
PRIOR_SLOPE = 0.1  # an unmeasured draft adds this share of a plain step's cost
MARGIN = 0.02  # drafting must beat a plain step's tokens per second by 2%: ties go to d = 0
PROBE_EVERY = 16


def expected_tokens(alpha: float, d: int) -> float:
    """E(d) = 1 + alpha + ... + alpha^d: tokens a round of d drafts emits (bonus included)."""
    return d + 1.0 if alpha >= 1.0 else (1 - alpha ** (d + 1)) / (1 - alpha)


class DraftPolicy:
    """Chooses a round's draft count from acceptance and cost observed so far.

    >>> p = DraftPolicy(max_drafts=4)
    >>> for _ in range(40):  # every draft rejected; a round of d drafts costs 1 + 0.1 d
    ...     d = p.choose(4)
    ...     p.observe(d, accepted=0, seconds=1.0 + 0.1 * d)
    >>> [p.choose(4) for _ in range(PROBE_EVERY)].count(0)  # one probe in PROBE_EVERY rounds
    15
    """

    def __init__(self, max_drafts: int) -> None:
        self.max_drafts = max_drafts
        self.accepted, self.rejections = 1.0, 1.0  # prior: alpha 0.5
        self.costs: dict[int, float] = {}  # d -> moving average of a round's seconds
        self.declined = 0  # rounds with drafts available that drafted none, since the last draft
        self._seen: set[int] = set()  # lengths that have run a round

    @property
    def alpha(self) -> float:
        return self.accepted / (self.accepted + self.rejections)

    def cost(self, d: int) -> float:
        """C(d) from the least-squares line through the measured lengths' averages (relative
        units before any measurement). The line, not a length's own average: a length whose
        few rounds ran slow (a busy machine, a first call at a new shape) would otherwise
        never be chosen again, so never be measured again."""
        points = sorted(self.costs.items())
        if not points:
            return 1.0 + PRIOR_SLOPE * d
        if len(points) == 1:
            (d1, c1) = points[0]
            return c1 * (1.0 + PRIOR_SLOPE * d) / (1.0 + PRIOR_SLOPE * d1)
        n = len(points)
        mx = sum(x for x, _ in points) / n
        my = sum(y for _, y in points) / n
        slope = sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x, _ in points)
        slope = max(slope, 0.0)  # a longer verify never costs less
        base = max(my - slope * mx, 1e-9)
        return base + slope * d

    def rate(self, d: int) -> float:
        """E(d) / C(d): expected tokens per unit of cost."""
        return expected_tokens(self.alpha, d) / self.cost(d)

    def choose(self, available: int) -> int:
        """Drafts for a round that could draft ``available`` (0: none possible)."""
        limit = min(available, self.max_drafts)
        if limit == 0:
            return 0
        best = max(range(1, limit + 1), key=self.rate)
        if self.rate(best) > (1.0 + MARGIN) * self.rate(0):
            self.declined = 0
            return best
        self.declined += 1
        if self.declined >= PROBE_EVERY:  # keep measuring what drafting would give
            self.declined = 0
            return 1
        return 0

    def observe(self, drafted: int, accepted: int, seconds: float) -> None:
        """A round drafted ``drafted`` tokens, kept ``accepted`` of them, took ``seconds``."""
        if drafted > 0:
            self.accepted = DECAY * self.accepted + accepted
            self.rejections = DECAY * self.rejections + (accepted < drafted)
        if drafted not in self._seen:  # its first round pays first-call costs: not counted
            self._seen.add(drafted)
            return
        old = self.costs.get(drafted)
        self.costs[drafted] = seconds if old is None else old + COST_EMA * (seconds - old)


class AdaptiveLookup:
    """Prompt lookup whose draft length a :class:`DraftPolicy` picks each round.

    ``propose`` learns the last round's outcome from what arrived since: with d drafts the
    text grew by k + 1 tokens (k accepted and the correction or bonus), timed from the last
    ``propose`` to this one."""

    def __init__(self, prompt: Sequence[int], max_drafts: int, max_ngram: int, min_ngram: int):
        self.lookup = PromptLookup(prompt, max_ngram, min_ngram)
        self.policy = DraftPolicy(max_drafts)
        self._last: tuple[int, int, float] | None = None  # (drafted, text length, start time)

    def propose(self, generated: Sequence[int], d: int) -> Drafts:
        now = time.perf_counter()
        if self._last is not None:
            drafted, length, start = self._last
            accepted = min(max(len(generated) - length - 1, 0), drafted)
            self.policy.observe(drafted, accepted, now - start)
        match = self.lookup.propose(generated, d)
        n = self.policy.choose(len(match.tokens))
        if n == 0:
            proposal = Drafts((), "declined" if match.tokens else "none")
        else:
            proposal = Drafts(match.tokens[:n], match.drafter, match.ngram)
        self._last = (n, len(generated), now)
        return proposal


def auto(
    runner: StageRunner,
    prompt: torch.Tensor,
    request: DecodeRequest,
    metrics: DecodeMetrics,
    num_speculations: int,
    max_ngram: int,
    min_ngram: int,
) -> list[int]:
    """Adaptive prompt-lookup decoding: at most ``num_speculations`` drafts a round, as many as
    pay for themselves (none where none do)."""
    drafter = AdaptiveLookup(prompt[0].tolist(), num_speculations, max_ngram, min_ngram)
    return drafted_loop(runner, prompt, request, metrics, num_speculations, drafter)
