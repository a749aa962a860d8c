"""Decode metrics, recorded by the schedules and read through ``SpeculativeModel.last_metrics``.

Definitions (Kangaroo eq. 1-2): a verify step k accepts ``s_k`` tokens, counting the bonus or
correction token the verifier emits, so ``s_k >= 1``.

- ``mean_accepted_tokens`` = mean of s_k (Kangaroo's compression rate, CR);
- ``acceptance_rate``      = accepted draft tokens / drafted tokens;
- ``ctar(w)``              = share of verify steps with s_k > w (all of the first w drafts
  accepted); ``ctar_curve`` holds w = 1..num_speculations.

Early exit (lossy recipes):

- ``avg_layers``     = mean decoder layers run per emitted token (a schedule records, for each
  token it emits, the layers its pass ran; None where a schedule records none);
- ``exit_histogram`` = {layers run: tokens};
- ``agreement``      = under teacher forcing (``generate(..., teacher_tokens=...)``: the full
  model's greedy tokens are emitted, the recipe decides with its own cache state), the share of
  positions whose own token equals the teacher's; None without teacher forcing.

Drafters chosen per round (prompt lookup, the adaptive drafter, a drafting recipe's own
drafter and, with its ``lookup=True``, prompt lookup before it):

- ``drafter_rounds`` = {drafter: rounds}: "lookup" for n-gram drafts, the recipe's name
  ("swift", "layerskip", "kangaroo", "m2r2", "eagle") for its own drafter's; rounds that
  drafted nothing are "none" (no n-gram match) or "declined" (a match, but the adaptive policy
  chose a plain step); those rounds are full calls, not verify steps, so acceptance and mean
  accepted length count only rounds that drafted;
- ``ngram_matches``  = {n: rounds whose drafts continued a match of the last n tokens}.

``swift`` with ``search="online"``: ``skip_search`` = the on-the-fly skip-set search after the
call (``OnlineSkipSearch.as_dict``: whether it is done, the set it drafts with, every trial's
rounds, acceptance and tokens/s); None for every other schedule.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class DecodeMetrics:
    """What one ``generate`` call did. Counts are exact; ``seconds`` is wall time."""

    schedule: str
    new_tokens: int = 0
    prompt_tokens: int = 0
    seconds: float = 0.0
    draft_calls: int = 0  # draft-stage forward calls (one token each)
    verify_calls: int = 0  # verify-remainder calls
    full_calls: int = 0  # full-model calls (prefill, autoregressive steps)
    drafted_tokens: int = 0
    accepted_drafts: int = 0
    accepted_per_verify: list[int] = field(default_factory=list)  # s_k, bonus included
    drafted_per_verify: list[int] = field(default_factory=list)  # drafts each verify checked
    num_speculations: int = 0
    stage_seconds: dict[str, float] = field(default_factory=dict)  # host time per stage
    layers_per_token: list[int] = field(default_factory=list)  # decoder layers per emitted token
    teacher_positions: int = 0  # positions decided under teacher forcing
    teacher_agreed: int = 0  # ... whose own token equalled the teacher's
    cpu_kernels: bool | None = None  # the stages ran leapfx's CPU kernels (None: not recorded)
    drafter_rounds: dict[str, int] = field(default_factory=dict)  # rounds per drafter
    ngram_matches: dict[int, int] = field(default_factory=dict)  # prompt lookup: n -> rounds
    skip_search: dict | None = None  # swift's online skip-set search after the call
    batch_size: int = 1  # rows decoded together (a batched generate's input_ids.shape[0])
    # a batched decode: the draft length each round chose (0: a plain step for every row)
    draft_lengths: list[int] = field(default_factory=list)

    def record_round(self, drafter: str, ngram: int = 0) -> None:
        """A round drafted with ``drafter`` ("none": drafted nothing); ``ngram`` > 0: its
        drafts continued a match of the last ``ngram`` tokens."""
        self.drafter_rounds[drafter] = self.drafter_rounds.get(drafter, 0) + 1
        if ngram > 0:
            self.ngram_matches[ngram] = self.ngram_matches.get(ngram, 0) + 1

    def record_layers(self, layers: int, tokens: int = 1) -> None:
        """``tokens`` emitted tokens each ran ``layers`` decoder layers."""
        self.layers_per_token.extend([layers] * tokens)

    def record_agreement(self, agreed: bool) -> None:
        self.teacher_positions += 1
        self.teacher_agreed += bool(agreed)

    @property
    def avg_layers(self) -> float | None:
        n = self.layers_per_token
        return sum(n) / len(n) if n else None

    @property
    def exit_histogram(self) -> dict[int, int]:
        hist: dict[int, int] = {}
        for n in self.layers_per_token:
            hist[n] = hist.get(n, 0) + 1
        return dict(sorted(hist.items()))

    @property
    def agreement(self) -> float | None:
        if not self.teacher_positions:
            return None
        return self.teacher_agreed / self.teacher_positions

    def record_verify(self, drafted: int, accepted: int) -> None:
        self.verify_calls += 1
        self.record_drafts(drafted, accepted)

    def record_drafts(self, drafted: int, accepted: int) -> None:
        """One sequence's drafts of a verify pass (a batch's rows share one pass: the batched
        loop counts the pass once in ``verify_calls`` and each row's drafts here)."""
        self.drafted_tokens += drafted
        self.accepted_drafts += accepted
        self.accepted_per_verify.append(accepted + 1)
        self.drafted_per_verify.append(drafted)

    @property
    def rejections(self) -> int:
        """Verify steps that rejected a draft (fewer accepted than drafted). With
        ``accepted_drafts`` this gives the per-token acceptance probability's geometric MLE,
        accepted / (accepted + rejections), whatever length each round drafted."""
        pairs = zip(self.drafted_per_verify, self.accepted_per_verify, strict=True)
        return sum(1 for drafted, s in pairs if s - 1 < drafted)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_drafts / self.drafted_tokens if self.drafted_tokens else 0.0

    @property
    def mean_accepted_tokens(self) -> float:
        s = self.accepted_per_verify
        return sum(s) / len(s) if s else 0.0

    def ctar(self, w: int) -> float:
        s = self.accepted_per_verify
        return sum(1 for x in s if x > w) / len(s) if s else 0.0

    @property
    def ctar_curve(self) -> list[float]:
        return [self.ctar(w) for w in range(1, self.num_speculations + 1)]

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else 0.0

    def as_dict(self) -> dict:
        return {
            "schedule": self.schedule,
            "new_tokens": self.new_tokens,
            "prompt_tokens": self.prompt_tokens,
            "seconds": self.seconds,
            "tokens_per_second": self.tokens_per_second,
            "draft_calls": self.draft_calls,
            "verify_calls": self.verify_calls,
            "full_calls": self.full_calls,
            "drafted_tokens": self.drafted_tokens,
            "accepted_drafts": self.accepted_drafts,
            "acceptance_rate": self.acceptance_rate,
            "mean_accepted_tokens": self.mean_accepted_tokens,
            "ctar": self.ctar_curve,
            "stage_seconds": dict(self.stage_seconds),
            "avg_layers": self.avg_layers,
            "exit_histogram": {str(k): v for k, v in self.exit_histogram.items()},
            "agreement": self.agreement,
            "cpu_kernels": self.cpu_kernels,
            "drafter_rounds": dict(self.drafter_rounds),
            "ngram_matches": {str(k): v for k, v in sorted(self.ngram_matches.items())},
            "skip_search": self.skip_search,
            "batch_size": self.batch_size,
            "draft_lengths": list(self.draft_lengths),
        }
