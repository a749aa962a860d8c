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
  A round's alpha is that of its match's n-gram length (a long match repeats text far more often
  than a one-token one), shrunk toward the pooled rate by ``SHRINK`` pseudo-rounds, so a length
  seen rarely reads as the pooled rate.
- C(d): each round's wall time, from one ``propose`` to the next (the verify call, the
  acceptance and its host sync, the crop, the lookup itself), as a moving average per d (robust
  to a stalled round: ``DraftPolicy.observe_cost``), read
  off the least-squares line through those averages (every d, measured or not), or from one
  measured point and ``PRIOR_SLOPE`` (a draft adds this share of a step); each length's first
  round is not counted (first-call costs at a new shape), nor a decode's last round (no
  ``propose`` follows it; where the budget's last token is left to a plain step, the round
  before it goes unobserved too: a round that left exactly one token to go rejected a draft
  more often than most, and counting it would bias alpha low on short decodes). Wall time is
  what a user waits for, on any backend: a round syncs once, so on a GPU it holds the kernels
  too. Costs are a property of the model on its machine, not of the text: they carry over from
  one ``generate`` call to the next on the same applied model (``auto`` keeps its policies
  with the model; acceptance starts from the prior each call), so a short decode does not
  spend its first rounds relearning them.
- Once drafting is off it is probed: after ``PROBE_EVERY`` declined rounds with a match, one
  round drafts a single token, so alpha and C(1) keep being measured (at most 1/PROBE_EVERY of
  the rounds pay a one-token verify).

``auto``'s drafter is prompt lookup (``leapfx.runtime.lookup``), through an
:class:`AdaptiveDrafter` with no drafter of its own (a drafting recipe's ``adaptive=True``
adds its own): a round without a match is a plain step whatever the policy says. Lossless for
any choice: only the draft lengths change. Greedy tokens are identical to the full model's;
the lengths (and so the sampled stream of a seeded generator) depend on timing, the sampled
distribution does not.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from .lookup import Drafts, LookupFirst, PromptLookup, copied_draft
from .metrics import DecodeMetrics
from .rounds import speculative_loop
from .runner import StageRunner
from .schedules import DecodeRequest, Draft, Drafter, Output, no_draft

DECAY = 0.9  # per drafting round: the acceptance counts' memory is ~10 rounds
COST_EMA = 0.2  # weight of a new round's time in its length's moving average (slower)
COST_EMA_DOWN = 0.5  # ... of a round faster than the average: stalls only lengthen rounds
OUTLIER = 3.0  # a round counts at most this many times its length's average cost
PRIOR_SLOPE = 0.1  # an unmeasured draft adds this share of a plain step's cost
MARGIN = 0.02  # drafting must beat a plain step's tokens per second by 2%: ties go to d = 0
PROBE_EVERY = 16
SHRINK = 2.0  # pseudo-rounds at the pooled rate in each n-gram length's acceptance


def expected_tokens(alpha: float, d: int) -> float:
    """E(d) = 1 + alpha + ... + alpha^d: tokens a round of d drafts emits (bonus included)."""
    return d + 1.0 if alpha >= 1.0 else (1 - alpha ** (d + 1)) / (1 - alpha)


class ProbeGate:
    """Whether a round with drafts available drafts: "draft" where the best choice beats a
    plain step by ``MARGIN``; else "decline", and every ``PROBE_EVERY``-th declined round in a
    row "probe" (one draft, so that acceptance and costs keep being measured)."""

    def __init__(self) -> None:
        self.declined = 0  # rounds with drafts available that drafted none, since the last draft

    def __call__(self, gain: float) -> str:
        if gain > 1.0 + MARGIN:
            self.declined = 0
            return "draft"
        self.declined += 1
        if self.declined >= PROBE_EVERY:  # keep measuring what drafting would give
            self.declined = 0
            return "probe"
        return "decline"


class Acceptance:
    """Live acceptance: the decayed counts of kept drafts and rejections over the rounds that
    drafted (pooled, and a key's own: an n-gram length's), from a prior of one of each.

    >>> a = Acceptance(); a.observe(3.0, 0.0); round(a.alpha, 3)  # (0.9 + 3) / (3.9 + 0.9)
    0.812
    """

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.accepted, self.rejections = 1.0, 1.0  # pooled; prior: alpha 0.5
        self.by_key: dict[int, list[float]] = {}  # n-gram length -> [accepted, rejections]

    def observe(self, accepted: float, rejected: float, key: int | None = None) -> None:
        """A drafting round kept ``accepted`` drafts and rejected one (``rejected`` 1) or none
        (0); a batch's round: the mean row's counts."""
        self.accepted = DECAY * self.accepted + accepted
        self.rejections = DECAY * self.rejections + rejected
        if key is not None:
            counts = self.by_key.setdefault(key, [0.0, 0.0])
            counts[0] = DECAY * counts[0] + accepted
            counts[1] = DECAY * counts[1] + rejected

    @property
    def alpha(self) -> float:
        return self.accepted / (self.accepted + self.rejections)

    def alpha_of(self, key: int | None) -> float:
        counts = self.by_key.get(key) if key is not None else None
        if counts is None:
            return self.alpha
        accepted, rejections = counts
        return (accepted + SHRINK * self.alpha) / (accepted + rejections + SHRINK)


class DraftPolicy:
    """Chooses a round's draft count from acceptance and cost observed so far.

    >>> p = DraftPolicy(max_drafts=4)
    >>> for _ in range(40):  # every draft rejected; a round of d drafts costs 1 + 0.1 d
    ...     d = p.choose(4)
    ...     p.observe(d, accepted=0, seconds=1.0 + 0.1 * d)
    >>> [p.choose(4) for _ in range(PROBE_EVERY)].count(0)  # one probe in PROBE_EVERY rounds
    15
    """

    def __init__(self, max_drafts: int, acceptance: Acceptance | None = None) -> None:
        self.max_drafts = max_drafts
        self.costs: dict[int, float] = {}  # d -> moving average of a round's seconds
        self._seen: set[int] = set()  # lengths that have run a round
        # a draft's share of a plain step while fewer than two lengths are measured (a batch's
        # policy borrows its neighbours' line: BatchPolicy)
        self.prior_slope = PRIOR_SLOPE
        # the text's acceptance: this policy's own, or one a batch's policies share (one a
        # batch size, all reading the live rows' acceptance)
        self.acceptance = Acceptance() if acceptance is None else acceptance
        self.restart()

    def restart(self) -> None:
        """A new decode: acceptance back to the prior (it is the text's); costs are kept."""
        self.acceptance.reset()
        self.gate = ProbeGate()

    @property
    def alpha(self) -> float:
        """The pooled acceptance rate over every drafting round."""
        return self.acceptance.alpha

    def alpha_of(self, key: int | None) -> float:
        """Acceptance of a round whose match is ``key`` (its n-gram length): that length's own
        counts plus ``SHRINK`` pseudo-rounds at the pooled rate (the pooled rate for None)."""
        return self.acceptance.alpha_of(key)

    def cost(self, d: int) -> float:
        """C(d) from the least-squares line through the measured lengths' averages (relative
        units before any measurement). The line, not a length's own average: a length whose
        few rounds ran slow (a busy machine, a first call at a new shape) would otherwise
        never be chosen again, so never be measured again. A plain step (d = 0), once
        measured, costs its own average: plain rounds are measured all the time, and where a
        verify's first extra token costs more than each later one (a compute-bound batch) the
        line's intercept lies above them, which would make every draft look cheaper than it
        is."""
        if d == 0 and 0 in self.costs:
            return self.costs[0]
        if not self.costs:
            return 1.0 + self.prior_slope * d
        line = self.line()
        if line is None:
            ((d1, c1),) = self.costs.items()
            return c1 * (1.0 + self.prior_slope * d) / (1.0 + self.prior_slope * d1)
        base, slope = line
        return base + slope * d

    def line(self) -> tuple[float, float] | None:
        """(intercept, slope) of the least-squares line through the measured lengths' average
        costs; None while fewer than two lengths are measured."""
        points = sorted(self.costs.items())
        if len(points) < 2:
            return None
        n = len(points)
        mx = sum(x for x, _ in points) / n
        my = sum(y for _, y in points) / n
        slope = sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x, _ in points)
        slope = max(slope, 0.0)  # a longer verify never costs less
        return max(my - slope * mx, 1e-9), slope

    def rate(self, d: int, key: int | None = None, share: float = 1.0) -> float:
        """E(d) / C(d): expected tokens per unit of cost (acceptance of ``key``'s rounds).
        ``share``: the part of a batch's rows that has drafts (the others emit one token for
        the same verify): 1 + share (E(d) - 1) tokens a row."""
        return (1.0 + share * (expected_tokens(self.alpha_of(key), d) - 1.0)) / self.cost(d)

    def best(self, available: int, key: int | None = None, share: float = 1.0) -> tuple[int, float]:
        """(d, gain): the draft count in 1..``available`` with the most expected tokens per
        cost, and its rate over a plain step's (no side effects; (0, 1.0) where
        ``available`` is 0 or no row drafts)."""
        limit = min(available, self.max_drafts)
        if limit == 0 or share <= 0:
            return 0, 1.0
        best = max(range(1, limit + 1), key=lambda d: self.rate(d, key, share))
        return best, self.rate(best, key, share) / self.rate(0, key)

    def choose(self, available: int, key: int | None = None, share: float = 1.0) -> int:
        """Drafts for a round that could draft ``available`` (0: none possible) from a match
        of kind ``key`` (the n-gram length; None: pooled); ``share`` as in :meth:`rate`."""
        best, gain = self.best(available, key, share)
        if best == 0:
            return 0
        return {"draft": best, "probe": 1, "decline": 0}[self.gate(gain)]

    def observe(self, drafted: int, accepted: int, seconds: float, key: int | None = None) -> None:
        """A round drafted ``drafted`` tokens from a match of kind ``key``, kept ``accepted``
        of them, took ``seconds``."""
        if drafted > 0:
            self.acceptance.observe(accepted, float(accepted < drafted), key)
        self.observe_cost(drafted, seconds)

    def observe_cost(self, drafted: int, seconds: float) -> None:
        """A round of ``drafted`` drafts took ``seconds`` (its acceptance counted apart).

        Robust to a stall: a round the machine held up (another process, a page fault, the
        collector) can be many steps long, and a length whose cost reads that high is never
        chosen again, so only rare probes could bring it back down. So a round counts at most
        ``OUTLIER`` times its length's average (its first counted round: ``OUTLIER`` times
        what d + 1 plain steps cost, where a plain step is measured: no verify of d + 1
        tokens costs more), and a round faster than the average pulls it down by
        ``COST_EMA_DOWN``, more than a slower one pushes it up: stalls only ever lengthen
        a round."""
        if drafted not in self._seen:  # its first round pays first-call costs: not counted
            self._seen.add(drafted)
            return
        old = self.costs.get(drafted)
        if old is None:
            step = self.costs.get(0) if drafted > 0 else None
            cap = None if step is None else OUTLIER * step * (drafted + 1)
            self.costs[drafted] = seconds if cap is None else min(seconds, cap)
            return
        if seconds > old:
            self.costs[drafted] = old + COST_EMA * (min(seconds, OUTLIER * old) - old)
        else:
            self.costs[drafted] = old + COST_EMA_DOWN * (seconds - old)


class Policies(dict):
    """One :class:`DraftPolicy` per drafter name, made on first use; kept a model's lifetime
    (their costs carry over between decodes, as ``auto``'s one policy does)."""

    def __init__(self, max_drafts: int = 64) -> None:
        super().__init__()
        self.max_drafts = max_drafts

    def __missing__(self, name: str) -> DraftPolicy:
        policy = self[name] = DraftPolicy(self.max_drafts)
        return policy


class AdaptiveDrafter(Drafter):
    """Per round, the choice among prompt lookup (where the text has a match), the recipe's own
    drafter (``own``) and no drafting at all with the most expected tokens per second, and how
    many drafts: each choice has its own :class:`DraftPolicy` (its acceptance, and the line of
    its measured round costs; a plain step's time goes to every policy, the point d = 0 all
    of them share). A choice drafts when it beats a plain step by ``MARGIN``; while none does,
    every ``PROBE_EVERY``-th round drafts one token with each choice in turn, so their
    acceptance and costs stay measured. Lossless for any choice: every round is verified by
    the full model (a lookup round by ``own.target``, as :class:`lookup.LookupThen`).

    ``own`` None: prompt lookup alone (the ``auto`` recipe). An ``own`` drafter that is
    ``exploring`` (swift's online skip-set search) runs every round until its search ends;
    one that is ``idle`` (the search found no set that pays) is no choice: lookup, where the
    text has a match, or plain steps."""

    def __init__(
        self, own: Drafter | None, lookup: PromptLookup | None, policies: Policies
    ) -> None:
        self.own, self.lookup, self.policies = own, lookup, policies
        for policy in policies.values():
            policy.restart()
        self.name = own.name if own is not None else None
        self.gate = ProbeGate()
        self._probes = 0
        # the last round: (choice or None for a plain step, drafted, key, start time)
        self._last: tuple[str | None, int, int | None, float] | None = None
        self._kept = 0

    def prefill(self, runner, prompt):
        return self.own.prefill(runner, prompt) if self.own else super().prefill(runner, prompt)

    def target(self, runner, ids, start, key=None):
        if self.own is not None:
            return self.own.target(runner, ids, start, key)
        return super().target(runner, ids, start, key)

    def _observe(self, now: float) -> None:
        choice, drafted, key, start = self._last
        seconds = now - start
        if choice is None:  # a plain step: the cost every choice's d = 0 reads
            for policy in self.policies.values():
                policy.observe(0, 0, seconds)
        else:
            self.policies[choice].observe(drafted, min(self._kept, drafted), seconds, key)

    def propose(self, runner, x, start, d, request, out) -> Draft:
        if self.own is not None and self.own.exploring:
            # it measures choices of its own (swift's online skip-set search): its rounds, at
            # full length, left out of the policies (they measure what it will not draft with)
            self._last = None
            return self.own.propose(runner, x, start, d, request, out)
        if d == 0:  # the budget's last token: unobserved, as the round before it (module doc)
            return no_draft(x)
        now = time.perf_counter()
        if self._last is not None:
            self._observe(now)
        self._last, self._kept = None, 0
        options = []  # (gain, choice, drafts, key)
        match = self.lookup.propose(out.tokens, d) if self.lookup is not None else None
        if match is not None and match.tokens:
            n, gain = self.policies["lookup"].best(len(match.tokens), match.ngram)
            options.append((gain, "lookup", n, match.ngram))
        if self.own is not None and not self.own.idle:
            n, gain = self.policies[self.own.name].best(d)
            options.append((gain, self.own.name, n, None))
        if not options:
            self._last = (None, 0, None, now)
            return no_draft(x, "none")
        gain, choice, n, key = max(options, key=lambda o: o[0])
        verdict = self.gate(gain)
        if verdict == "decline":
            self._last = (None, 0, None, now)
            return no_draft(x, "declined")
        if verdict == "probe":  # one draft with each choice in turn
            _, choice, _, key = options[self._probes % len(options)]
            self._probes += 1
            n = 1
        if choice == "lookup":
            draft = copied_draft(Drafts(match.tokens[:n], "lookup", match.ngram), x)
        else:
            draft = self.own.propose(runner, x, start, n, request, out)
        self._last = (choice, draft.tokens.shape[1], key, now)
        return draft

    def verify(self, runner, x, start, draft, request):
        if draft.copied or self.own is None:
            return self.target(runner, torch.cat([x, draft.tokens], dim=1), start, "verify")
        return self.own.verify(runner, x, start, draft, request)

    def accepted(self, runner, start, k):
        self._kept = k
        if self.own is not None:
            self.own.accepted(runner, start, k)


def auto(
    runner: StageRunner,
    prompt: torch.Tensor,
    request: DecodeRequest,
    metrics: DecodeMetrics,
    num_speculations: int,
    max_ngram: int,
    min_ngram: int,
    policies: Policies | None = None,
) -> list[int]:
    """Adaptive prompt-lookup decoding: at most ``num_speculations`` drafts a round, as many as
    pay for themselves (none where none do): an :class:`AdaptiveDrafter` with prompt lookup
    and no drafter of its own. ``policies``: the model's, whose measured costs carry over
    between calls (fresh ones when None)."""
    metrics.num_speculations = num_speculations
    lookup = PromptLookup(prompt[0].tolist(), max_ngram, min_ngram)
    drafter = AdaptiveDrafter(None, lookup, policies if policies is not None else Policies())
    return speculative_loop(runner, prompt, request, metrics, num_speculations, drafter)


@dataclass(frozen=True)
class Adaptive:
    """A drafting recipe's ``adaptive=True``: its rounds run through an
    :class:`AdaptiveDrafter` over its own drafter and, with ``lookup=True``, prompt lookup.
    ``policies``: the model's, made once per applied model (their costs carry over)."""

    lookup: LookupFirst | None
    policies: Policies = field(default_factory=Policies, compare=False)

    def wrap(self, own: Drafter, prompt: torch.Tensor, out: Output) -> Drafter:
        lookup = self.lookup.drafter(prompt) if self.lookup is not None else None
        return AdaptiveDrafter(own, lookup, self.policies)
