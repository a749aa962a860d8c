"""Batched decoding: ``generate`` on ``[B, S]`` prompts with left padding, each row accepting its
own drafts over one static KV cache.

The rows' cache is ``runtime.rows``'s ``RowKVCache`` (left padding, a fill length per row,
per-row crop), run by the one ``runtime.runner.StageRunner`` (each row at its own columns, row
prefill). The rounds are ``runtime.rounds.Decode``'s, drafted by :class:`BatchDrafter`.

A round, for every live row at once::

    choose d   the batch's policy (:class:`BatchPolicy`): live acceptance, the share of rows
               with drafts (lookup: those with a match), and the measured cost of a verify of
               B x (d + 1) tokens at this batch size; 0 = a plain step
    propose    per row: prompt lookup (an n-gram index per row), or the recipe's draft
               stage, d calls over [B, 1] (layer-skip drafts: layerskip, kangaroo, swift), or
               lookup first and the draft stage for the rows without a match
    verify     one ``full`` call over [x_b, drafts_b] for every row at its own positions;
               a row with fewer drafts than d is filled, and its fillers are never accepted
    accept     per row: greedy, the drafts up to the first mismatch; sampling, rejection
               sampling over the row's own drafts (one generator, rows in order); then each
               row's cache is cropped to its own kept prefix

A row that stops (EOS, ``max_new_tokens``) leaves the batch: the cache keeps the live rows (one
``index_select`` a layer when rows stop, cheaper than carrying a dead row through every later
call), so a finished row costs nothing afterwards. The verify is the full model, so every
proposal is lossless: greedy rows equal HF's ``generate`` on the same padded batch, sampled rows
have its distribution.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .adaptive import PRIOR_SLOPE, Acceptance, DraftPolicy
from .eagle import EagleDrafter, draft_chain
from .lookup import NgramIndex
from .metrics import DecodeMetrics
from .rounds import Decode, Proposal, RoundDrafter, Row, requests_of_rows
from .runner import StageRunner
from .schedules import DecodeRequest, draft, requests_of

DRAFTERS = ("none", "lookup", "stage", "eagle")
# Backends whose stages take a batch's ragged rows: the eager stages, and the compiled ones
# (``lower.inductor``: a batch's graphs write each row at its own columns). ONNX sessions take
# one row.
BATCH_BACKENDS = ("eager", "inductor")


@dataclass(frozen=True)
class BatchPlan:
    """How a recipe drafts in a batch (``Recipe.batch``): ``drafter`` "none" (plain steps),
    "lookup" (prompt lookup), "stage" (the recipe's ``draft`` stage, a layer-skip draft
    verified by the ``full`` stage) or "eagle" (EAGLE's ``head`` stage on each row's last
    hidden state, verified by the ``target`` stage); ``lookup``: prompt lookup first for a
    "stage" or "eagle" drafter (``lookup=True``); at most ``num_speculations`` drafts a round;
    ``threshold``: an "eagle" row stops drafting after a draft whose top-1 probability is at
    most this (0: never)."""

    drafter: str = "none"
    num_speculations: int = 0
    lookup: bool = False
    max_ngram: int = 3
    min_ngram: int = 1
    name: str = ""  # counted under this name in ``drafter_rounds`` (the recipe's)
    # verify a round of stage drafts with the ``verify`` stage over their exit states (the
    # upper layers on d + 1 tokens, the lower ones on the last draft only: LayerSkip's split)
    split_verify: bool = False
    threshold: float = 0.0

    def __post_init__(self) -> None:
        if self.drafter not in DRAFTERS:
            raise ValueError(f"drafter: {self.drafter!r} is invalid; allowed: {DRAFTERS}")


class BatchPolicy:
    """Draft lengths for batched rounds: one :class:`~leapfx.runtime.adaptive.DraftPolicy` a
    batch size, since what a verify of B x (d + 1) tokens costs is the batch's (compute-bound
    as B grows: speculation stops paying), while the acceptance is the text's and moves with
    the decode to whatever size is live. Costs carry over between calls (the model's, on its
    machine); acceptance restarts each call."""

    def __init__(self, max_drafts: int) -> None:
        self.max_drafts = max_drafts
        self.acceptance = Acceptance()  # the live rows', whatever their number
        self.by_size: dict[int, DraftPolicy] = {}

    def restart(self) -> None:
        self.acceptance.reset()
        for policy in self.by_size.values():
            policy.restart()

    def at(self, size: int) -> DraftPolicy:
        """The draft policy at batch ``size``: its own costs, the batch's acceptance."""
        policy = self.by_size.get(size)
        if policy is None:
            policy = self.by_size[size] = DraftPolicy(self.max_drafts, self.acceptance)
        if policy.line() is None:
            policy.prior_slope = self._slope_near(size)
        return policy

    def _slope_near(self, size: int) -> float:
        """A draft's share of a plain step at the measured batch size nearest ``size`` (the
        larger one on a tie: its verifies are the dearer, so drafting is judged no cheaper
        than it is), or ``PRIOR_SLOPE`` where no size has measured two lengths. A size that
        rows leave for (8 rows, then 7, 6, ...) would otherwise start from the prior, which
        a compute-bound batch's verifies are several times steeper than, and spend its first
        rounds drafting what does not pay."""
        best = None
        for other, policy in self.by_size.items():
            line = policy.line() if other != size else None
            if line is None:
                continue
            rank = (abs(other - size), -other)
            if best is None or rank < best[0]:
                best = rank, line[1] / line[0]
        return PRIOR_SLOPE if best is None else best[1]

    def choose(self, size: int, available: int, share: float = 1.0) -> int:
        """Drafts for a round at batch ``size`` that could draft ``available``, where a
        ``share`` of the rows has drafts (prompt lookup: the rows with a match; the verify
        costs the same for all, and a row without drafts gains nothing from it). A size's first
        rounds are plain steps until one has been timed (its first round is not counted): the
        cost of a plain step at this size is what every draft length is weighed against, and
        the prior's slope is far from a compute-bound batch's."""
        policy = self.at(size)
        if 0 not in policy.costs:
            return 0
        return policy.choose(available, share=share)

    def observe(self, size: int, drafted: int, rows: list[tuple[int, int]], seconds: float) -> None:
        """A round at batch ``size`` was ``drafted`` wide and took ``seconds``; ``rows``: (drafts,
        kept) of each row that drafted. Acceptance counts as the mean row's (a row rejects when
        it kept fewer than it drafted), the cost as this size's."""
        policy = self.at(size)
        if drafted > 0 and rows:
            n = len(rows)
            self.acceptance.observe(sum(k for _, k in rows) / n, sum(k < v for v, k in rows) / n)
        policy.observe_cost(drafted, seconds)


class BatchDecode(Decode):
    """A batch's :class:`~leapfx.runtime.rounds.Decode`: its rows drafted by a
    :class:`BatchDrafter` of the recipe's ``plan`` over a ragged ``StageRunner``. ``policy``
    chooses each round's draft length (None: always ``plan.num_speculations``).
    ``batched_loop`` is ``start`` then rounds until no row is left; a server admits its
    requests between rounds (continuous batching)."""

    def __init__(
        self,
        runner: StageRunner,
        metrics: DecodeMetrics,
        plan: BatchPlan,
        policy: BatchPolicy | None,
    ) -> None:
        super().__init__(runner, metrics, BatchDrafter(plan, policy))
        self.plan, self.policy = plan, policy
        if policy is not None:
            policy.restart()


def batched_loop(
    runner: StageRunner,
    prompt: torch.Tensor,
    pads: list[int],
    request: DecodeRequest | Sequence[DecodeRequest],
    metrics: DecodeMetrics,
    plan: BatchPlan,
    policy: BatchPolicy | None,
) -> list[list[int]]:
    """Decode every row of ``prompt`` [B, S] (left-padded by ``pads``); returns each row's new
    tokens (up to and including its EOS). ``request``: one for every row, or one a row (its
    own budget, EOS, sampling, generator, processors and streamer). A row's streamer gets its
    prompt row, each group of tokens the row emits, and ``end()`` when the row finishes.
    ``policy`` chooses each round's draft length (None: always ``plan.num_speculations``)."""
    decode = BatchDecode(runner, metrics, plan, policy)
    decode.start(prompt, pads, requests_of(request, prompt.shape[0]))
    decode.run()
    return [decode.finished.pop(b) for b in range(prompt.shape[0])]


class BatchDrafter(RoundDrafter):
    """A batch's drafts (``plan``): per row, a prompt-lookup match where the plan looks up
    (an n-gram index a row), else the recipe's draft stage (d calls over [B, 1]: layerskip,
    kangaroo, swift, qspec) or EAGLE's head on each row's last hidden state; verified by one
    ``full`` (EAGLE: ``target``) call over [x_b, drafts_b] for every row at its own columns,
    or, where every row's tokens are the draft stage's d, LayerSkip's split ``verify`` over
    their exit states. The drafts are the single sequence's drafting over each row's
    columns (``schedules.draft``; EAGLE: an ``eagle.EagleDrafter`` holding each row's state).
    ``policy`` chooses each round's d from the live acceptance and the measured cost of a round
    at this batch size (None: ``plan.num_speculations``)."""

    def __init__(
        self, plan: BatchPlan, policy: BatchPolicy | None, eagle: EagleDrafter | None = None
    ) -> None:
        self.plan, self.policy = plan, policy
        if eagle is None and plan.drafter == "eagle":
            eagle = EagleDrafter(plan.threshold)
        self.eagle = eagle
        self._d = 0  # the round's draft length (a split verify needs every row at it)

    def new_row(self, row: Row, prompt: list[int]) -> None:
        if self.plan.drafter == "lookup" or self.plan.lookup:
            row.ngrams = NgramIndex(self.plan.max_ngram, self.plan.min_ngram)
            row.ngrams.extend(prompt)

    def prefill(self, runner: StageRunner, prompt: torch.Tensor) -> torch.Tensor:
        if self.eagle is not None:
            return self.eagle.prefill(runner, prompt)
        return runner.prefill("full", prompt)["logits"]  # [B, 1 or S, V]

    def propose(self, runner, rows, x, room, metrics) -> Proposal:
        plan, policy, size = self.plan, self.policy, len(rows)
        d = min(plan.num_speculations, max(room)) if plan.drafter != "none" else 0
        # each row's prompt-lookup match, up to d tokens (none without an n-gram index)
        copies = [_lookup_drafts(row, max(0, min(d, r))) for row, r in zip(rows, room, strict=True)]
        if policy is not None and d > 0:
            drafting = plan.drafter in ("stage", "eagle")
            share = 1.0 if drafting else sum(map(bool, copies)) / size
            d = policy.choose(size, d, share)
        requests = requests_of_rows(rows)
        proposal = _propose(runner, rows, x, d, room, plan, requests, copies, self.eagle)
        metrics.draft_calls += proposal.calls
        self._d = d
        return proposal

    def verify(self, runner, rows, x, proposal, metrics) -> torch.Tensor:
        starts = [row.pos for row in rows]
        width = proposal.width
        if self.plan.split_verify and proposal.hidden is not None and width == self._d > 0:
            # the draft stage ran every row d steps (its lower layers hold x .. t_{d-1}):
            # verify their exit states and t_d
            logits = runner.verify(proposal.tokens[:, -1:], proposal.hidden, starts)
        else:
            runner.cache.crop_rows(starts)  # a draft stage wrote some layers past x
            ids = torch.cat([x, proposal.tokens], dim=1)  # [B, width + 1]
            key = "verify" if width else "full"
            if self.eagle is not None:
                logits = self.eagle.target(runner, ids, starts, key)  # [B, width + 1, V]
            else:
                logits = runner.full(ids, starts, key)
        if width:
            metrics.verify_calls += 1
        else:
            metrics.full_calls += 1
        return logits

    def accepted(self, runner, rows, proposal, kept, metrics, seconds) -> None:
        if self.eagle is not None:
            self.eagle.accepted(runner, [row.pos for row in rows], kept)
        for row, v, k, who in zip(rows, proposal.valid, kept, proposal.drafters, strict=True):
            if v > 0:
                metrics.record_drafts(v, k)
                metrics.record_round(who)
                row.drafted += v
                row.kept += k
        metrics.draft_lengths.append(proposal.width)
        if self.policy is not None:
            drafted = [(v, k) for v, k in zip(proposal.valid, kept, strict=True) if v > 0]
            self.policy.observe(len(rows), proposal.width, drafted, seconds)

    def keep(self, live: list[int]) -> None:
        if self.eagle is not None:
            self.eagle.keep(live)

    def join(self, other: BatchDrafter) -> None:
        if self.eagle is not None:
            self.eagle.join(other.eagle)

    def alone(self) -> BatchDrafter:
        # it prefills one row; its EAGLE states join the batch's
        return BatchDrafter(self.plan, None, EagleDrafter(0.0) if self.eagle is not None else None)


def _lookup_drafts(row: Row, d: int) -> list[int]:
    if row.ngrams is None or d <= 0:
        return []
    tokens, _ = row.ngrams.match(d)
    return list(tokens)


def _propose(
    runner: StageRunner,
    rows: list[Row],
    x: torch.Tensor,
    d: int,
    room: list[int],
    plan: BatchPlan,
    requests: list[DecodeRequest],
    matches: list[list[int]],
    eagle: EagleDrafter | None = None,
) -> Proposal:
    """Up to d drafts a row (at most ``room[b]`` for row b); ``matches``: each row's prompt
    lookup match (cut to d here); ``eagle``: EAGLE's states, for an "eagle" drafter."""
    B = len(rows)
    caps = [max(0, min(d, r)) for r in room]
    copies = [m[:c] for m, c in zip(matches, caps, strict=True)]
    staged = None
    drafting = plan.drafter in ("stage", "eagle")
    own = caps  # how many of the drafter's own drafts each row may take
    if drafting and d > 0 and not all(copies[b] for b in range(B) if caps[b]):
        staged = _own_drafts(runner, rows, x, d, requests, eagle)
        if staged[3] is not None:
            own = [min(c, v) for c, v in zip(caps, staged[3], strict=True)]
    tokens: list[list[int]] = []
    copied: list[bool] = []
    drafters: list[str] = []
    for b in range(B):
        if copies[b]:
            tokens.append(copies[b][: caps[b]])
            copied.append(True)
            drafters.append("lookup")
        elif staged is not None and own[b] > 0:
            tokens.append(staged[0][b, : own[b]].tolist())
            copied.append(False)
            drafters.append(plan.name or "stage")
        else:
            tokens.append([])
            copied.append(False)
            drafters.append("none")
    valid = [len(t) for t in tokens]
    width = max(valid, default=0)
    q = None
    if width and staged is not None and staged[1] is not None:
        q = staged[1][:, :width]
    calls = staged[0].shape[1] if staged is not None else 0
    if staged is not None and width == d and not any(copied):
        # every row's tokens are the stage's (a row with fewer valid drafts keeps the stage's
        # in place of filler): its exit states serve a split verify
        return Proposal(staged[0], valid, q, copied, drafters, staged[2], calls)
    filled = [t + [0] * (width - len(t)) for t in tokens]
    ids = torch.tensor(filled, dtype=x.dtype, device=x.device).reshape(B, width)
    return Proposal(ids, valid, q, copied, drafters, calls=calls)


def _own_drafts(
    runner: StageRunner,
    rows: list[Row],
    x: torch.Tensor,
    d: int,
    requests: list[DecodeRequest],
    eagle: EagleDrafter | None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, list[int] | None]:
    """Up to d drafts a row by the single sequence's drafting, each row at its own columns:
    EAGLE's head on each row's h (``eagle.draft_chain``: with a threshold, a row stops after
    an unsure draft) or the ``draft`` stage (``schedules.draft``). Returns the tokens [B, n],
    under sampling q [B, n, V], the draft stage's exit states of the tokens fed (x ..
    t_{d-1}) [B, d, H] where it gives them, and each row's valid count (None: every row's d).
    Both write cache layers past each row's start; the verify crops them (``crop_rows``)."""
    starts = [row.pos for row in rows]
    if eagle is not None:
        drafts, q, valid = draft_chain(runner, x, eagle.h, starts, d, eagle.threshold, requests)
        return drafts, q, None, valid
    drafts, hidden, q = draft(runner, x, starts, d, requests)
    return drafts, q, hidden, None
