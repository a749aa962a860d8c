"""One decode round for one row or many: the draft-then-verify loop every drafting schedule runs.

:class:`Decode` holds the live rows of a decode (one for ``generate`` on a prompt, B for a
batch, rows joining and leaving for a server) and runs a round for all of them at once::

    propose   the drafter's drafts for every row, at most ``room[b]`` for row b ([B, w], a
              row's first ``valid[b]`` its own, the rest filler); w = 0: a plain step
    verify    the target over [x_b, drafts_b] at each row's own position: logits [B, w + 1, V]
    accept    per row: greedy, the drafts up to the first mismatch and the target's token
              after them; sampling, rejection sampling over the row's own drafts
    crop      each row's cache to its kept prefix (O(1): lengths move, nothing is copied)
    emit      each row's tokens to its Output (its stop rule, processors and streamer); a row
              that finished leaves, and the cache keeps the live rows

What differs between schedules is the drafter (:class:`RoundDrafter`), not the loop:

- ``runtime.batch.BatchDrafter``: any number of rows over a ragged ``StageRunner`` (each row
  at its own columns of one ``rows.RowKVCache``): prompt lookup per row, the recipe's draft
  stage, EAGLE's head, and the batch's draft-length policy.
- :class:`OneRow`: one row over a ``StageRunner`` of one sequence, through the single-sequence
  :class:`~leapfx.runtime.schedules.Drafter` protocol, which every recipe's drafter speaks
  (LayerSkip's exit, Kangaroo's adapter, swift's skip set and its online search, EAGLE,
  M2R2's fast stream, SpecEE, prompt lookup, the adaptive drafter). Its acceptance keeps the
  single row's device path: on a GPU the round syncs once (``schedules.accept``).

:func:`speculative_loop` is :class:`Decode` over one row and :class:`OneRow`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from .metrics import DecodeMetrics
from .runner import StageRunner
from .schedules import (
    DecodeRequest,
    Draft,
    Drafter,
    DraftFn,
    ExitDrafter,
    FirstDrafter,
    Output,
    accept,
    accept_rows,
    choose,
    draft,
    point_mass,
    shared_request,
)

if TYPE_CHECKING:
    from .lookup import NgramIndex

__all__ = [
    "Decode",
    "OneRow",
    "Proposal",
    "Row",
    "RoundDrafter",
    "choose_rows",
    "run_drafter",
    "self_speculative",
    "speculative_loop",
]


@dataclass
class Row:
    """One row's decode: its Output, its newest token's position (column in a ragged cache),
    its prompt-lookup index, and the drafts it was given to verify and of them kept."""

    index: int  # the row's place in the caller's batch
    out: Output
    pos: int = 0
    ngrams: NgramIndex | None = None
    drafted: int = 0
    kept: int = 0

    @property
    def request(self) -> DecodeRequest:
        return self.out.request


def requests_of_rows(rows: list[Row]) -> list[DecodeRequest]:
    return [row.request for row in rows]


def choose_rows(logits: torch.Tensor, requests: list[DecodeRequest]) -> torch.Tensor:
    """Each row's next token [B, 1] from logits [B, V] (``schedules.choose``): at once where
    the rows share one request without processors, else a row at a time, in order."""
    one = shared_request(requests)
    if one is not None and (one.processing is None or not one.processing.active):
        return choose(logits, one)
    return torch.cat([choose(logits[b : b + 1], r) for b, r in enumerate(requests)])


@dataclass(frozen=True)
class Proposal:
    """A round's drafts for every row: ``tokens`` [B, width] (a row's first ``valid[b]`` are
    its drafts, the rest filler), ``q`` [B, width, V] under sampling (None: greedy), ``copied``
    per row (a lookup copy: its q is a point mass), ``drafters`` per row (who drafted).

    ``hidden``: where every row's tokens are a draft stage's, their exit states [B, d, H]
    (for a split verify); ``calls``: draft-stage calls the round made; ``draft``: a single
    row's :class:`~leapfx.runtime.schedules.Draft` (what its drafter's ``verify`` reads);
    ``final``: (token [1, 1], logits [1, V]) of a round that emits a token without a verify
    (SpecEE: a first pass that ran every layer over an exact context)."""

    tokens: torch.Tensor
    valid: list[int]
    q: torch.Tensor | None = None
    copied: list[bool] | None = None
    drafters: list[str] | None = None
    hidden: torch.Tensor | None = None
    calls: int = 0
    draft: Draft | None = None
    final: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def width(self) -> int:
        return self.tokens.shape[1]


class RoundDrafter:
    """What :class:`Decode` asks of a drafter, for the live rows of a round.

    ``prefill`` gives the logits [B, 1 or S, V] of the prompts (and fills every cache layer the
    drafter reads); ``propose`` the round's :class:`Proposal` (``room[b]``: the most drafts row
    b may take); ``verify`` the target's logits [B, width + 1, V] over [x, drafts] (width 0: a
    plain step); ``accept`` each row's emitted tokens and kept count (and, where it has it
    on the device, the next x [B, 1]); ``accepted`` hears the round's outcome after the cache
    was cropped to each row's kept prefix (and counts it in ``metrics``); ``keep`` and
    ``join`` follow the rows that stay and those that join (state a drafter holds a row)."""

    def new_row(self, row: Row, prompt: list[int]) -> None:
        """A row starts (``prompt``: its own tokens, no padding)."""

    def prefill(self, runner: Any, prompt: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def propose(
        self, runner: Any, rows: list[Row], x: torch.Tensor, room: list[int],
        metrics: DecodeMetrics,
    ) -> Proposal:  # fmt: skip
        raise NotImplementedError

    def verify(
        self, runner: Any, rows: list[Row], x: torch.Tensor, proposal: Proposal,
        metrics: DecodeMetrics,
    ) -> torch.Tensor:  # fmt: skip
        raise NotImplementedError

    def accept(
        self, proposal: Proposal, logits: torch.Tensor, requests: list[DecodeRequest]
    ) -> tuple[list[list[int]], list[int], torch.Tensor | None]:
        emitted, kept = accept_rows(
            proposal.tokens, proposal.valid, proposal.q, proposal.copied, logits, requests
        )
        return emitted, kept, None

    def accepted(
        self, runner: Any, rows: list[Row], proposal: Proposal, kept: list[int],
        metrics: DecodeMetrics, seconds: float,
    ) -> None:  # fmt: skip
        """The round kept ``kept[b]`` drafts of row b (``seconds``: its time so far)."""

    def keep(self, live: list[int]) -> None:
        """Only the rows ``live`` (indices into the round's rows) go on."""

    def join(self, other: RoundDrafter) -> None:
        """``other``'s rows (a drafter of a one-row decode) join after this one's."""

    def alone(self) -> RoundDrafter:
        """A drafter of the same kind for one row prefilled alone (``Decode.admit``)."""
        return self


class Decode:
    """A decode a round at a time over one runner and its cache: ``start`` prefills a batch of
    rows (left-padded), ``admit`` prefills one more row (alone, in a one-row cache of the same
    length) and joins it between rounds, ``round`` runs one round (module doc) for every live
    row, and a row that finished (or was ``cancel``-ed) leaves after it. What a row emits goes
    to its Output (its streamer); a finished row's tokens wait in ``finished`` under its index
    (``pop`` them), its (drafts verified, drafts kept) in ``acceptance``.

    ``streams``: whether the decode gives a row's streamer its prompt and ``end()`` (False
    where the caller does, ``speculative_loop``'s)."""

    def __init__(
        self,
        runner: Any,
        metrics: DecodeMetrics,
        drafter: RoundDrafter,
        *,
        streams: bool = True,
    ) -> None:
        self.runner, self.metrics, self.drafter, self.streams = runner, metrics, drafter, streams
        self.rows: list[Row] = []
        self.x: torch.Tensor | None = None  # [B, 1]: each live row's newest token
        self.finished: dict[int, list[int]] = {}
        self.acceptance: dict[int, tuple[int, int]] = {}

    def _new_rows(
        self, prompt: torch.Tensor, pads: list[int], outs: list[Output], indices
    ) -> list[Row]:
        S = prompt.shape[1]
        rows = [Row(i, out, pos=S) for i, out in zip(indices, outs, strict=True)]
        for b, row in enumerate(rows):
            if self.streams and row.request.streamer is not None:
                row.request.streamer.put(prompt[b : b + 1].cpu())  # [1, S]
            self.drafter.new_row(row, prompt[b, pads[b] :].tolist())
        return rows

    def _prefill(self, drafter: RoundDrafter, runner, prompt: torch.Tensor) -> torch.Tensor:
        """The last prompt position's logits of each row of ``prompt``: [B, V]."""
        logits = drafter.prefill(runner, prompt)  # [B, 1 or S, V]
        self.metrics.full_calls += 1
        return logits[:, -1]

    def start(
        self,
        prompt: torch.Tensor,
        pads: list[int],
        requests: list[DecodeRequest],
        outs: list[Output] | None = None,
    ) -> None:
        """Prefill the rows of ``prompt`` [B, S] (left-padded by ``pads``; the runner's) in one
        batch, indices 0..B-1, and emit each row's first token. ``outs``: the rows' Outputs
        (fresh ones when None)."""
        outs = [Output(r) for r in requests] if outs is None else outs
        rows = self._new_rows(prompt, pads, outs, range(prompt.shape[0]))
        logits = self._prefill(self.drafter, self.runner, prompt)  # [B, V]
        x = choose_rows(logits, requests_of_rows(rows))  # [B, 1]
        self.rows, self.x = rows, x
        self._emit(rows, [[t] for t in x[:, 0].tolist()], logits[:, None])
        self._drop_finished()

    def admit(self, prompt: torch.Tensor, request: DecodeRequest, index: int) -> None:
        """Join the row ``prompt`` [1, n] (no padding) under ``index``: its prefill runs alone,
        on a one-row runner whose cache has the batch's length (``runner.alone()``), by a
        one-row drafter of the batch's kind; both then join the batch's. Its first token is
        emitted here."""
        runner, drafter = self.runner.alone(), self.drafter.alone()
        saved, self.drafter = self.drafter, drafter
        try:
            (row,) = self._new_rows(prompt, [0], [Output(request)], [index])
            logits = self._prefill(drafter, runner, prompt)  # [1, V]
        finally:
            self.drafter = saved
        x = choose_rows(logits, [request])  # [1, 1]
        for key, seconds in runner.seconds.items():
            self.runner.seconds[key] += seconds
        self.runner.join(runner)
        self.drafter.join(drafter)
        self.rows.append(row)
        self.x = x if self.x is None or not len(self.x) else torch.cat([self.x, x])
        self._emit([row], [[int(x[0, 0])]], logits[:, None])
        self._drop_finished()

    def cancel(self, index: int) -> None:
        """Stop the row ``index`` (a client that left): it leaves after this round."""
        for row in self.rows:
            if row.index == index:
                row.out.done = True
        self._drop_finished()

    def round(self) -> None:
        """One round for every live row: propose, verify, accept, crop, emit."""
        runner, metrics, drafter, rows, x = (
            self.runner,
            self.metrics,
            self.drafter,
            self.rows,
            self.x,
        )
        begin = time.perf_counter()
        room = [row.out.remaining - 1 for row in rows]  # drafts past a row's budget are waste
        proposal = drafter.propose(runner, rows, x, room, metrics)
        if proposal.final is not None:  # one row's token, emitted without a verify
            token, logits = proposal.final
            rows[0].pos += 1
            self.x = token.view(1, 1)
            self._emit(rows, [[int(token.reshape(-1)[0])]], logits[None])
            self._drop_finished()
            return
        starts = [row.pos for row in rows]
        logits = drafter.verify(runner, rows, x, proposal, metrics)  # [B, width + 1, V]
        emitted, kept, nxt = drafter.accept(proposal, logits, requests_of_rows(rows))
        runner.cache.crop_rows([s + len(e) for s, e in zip(starts, emitted, strict=True)])
        drafter.accepted(runner, rows, proposal, kept, metrics, time.perf_counter() - begin)
        for row, e in zip(rows, emitted, strict=True):
            row.pos += len(e)
        if nxt is None:
            nxt = torch.tensor([[e[-1]] for e in emitted], device=x.device)
        self.x = nxt
        self._emit(rows, emitted, logits)
        self._drop_finished()

    def run(self) -> None:
        """Rounds until no row is left."""
        while self.rows:
            self.round()

    def _emit(self, rows: list[Row], emitted: list[list[int]], logits: torch.Tensor) -> None:
        # logits [B, >= len(emitted[b]), V]: row b's tokens were chosen from its first rows
        for b, (row, tokens) in enumerate(zip(rows, emitted, strict=True)):
            row.out.extend(tokens, logits[b, : len(tokens)])
            if row.ngrams is not None:
                row.ngrams.extend(tokens)

    def _drop_finished(self) -> None:
        """Keep the rows still decoding (and their newest tokens); the cache (and the
        drafter's state) keep only theirs. A finished row's streamer ends."""
        rows = self.rows
        live = [i for i, row in enumerate(rows) if not row.out.done]
        if len(live) == len(rows):
            return
        for row in rows:
            if row.out.done:
                self.finished[row.index] = row.out.tokens
                self.acceptance[row.index] = (row.drafted, row.kept)
                if self.streams and row.request.streamer is not None:
                    row.request.streamer.end()
        self.runner.keep(live)
        self.drafter.keep(live)
        self.rows, self.x = [rows[i] for i in live], self.x[live]


class OneRow(RoundDrafter):
    """One row's rounds through a single-sequence :class:`~leapfx.runtime.schedules.Drafter`
    (its ``propose``, ``verify``, ``target`` and ``accepted`` on a ``StageRunner``), at most
    ``num_speculations`` drafts a round.

    A round that drafts nothing (prompt lookup without a match, the budget's last token) is a
    plain ``target`` step, counted as a full call, not a verify. Acceptance: on a CPU the
    batch's (``schedules.accept_rows``: greedy on the host, ~5 us against ~20 us for the device
    op's dispatch; rejection sampling and processors through ``schedules.accept``); on an
    accelerator ``schedules.accept``'s device ops, whose k, next token and drafts are read in
    one host sync, the next x staying on the device."""

    def __init__(self, drafter: Drafter, num_speculations: int) -> None:
        self.drafter, self.num_speculations = drafter, num_speculations

    def prefill(self, runner: StageRunner, prompt: torch.Tensor) -> torch.Tensor:
        return self.drafter.prefill(runner, prompt)

    def propose(self, runner, rows, x, room, metrics) -> Proposal:
        (row,) = rows
        d = min(self.num_speculations, room[0])
        draft = self.drafter.propose(runner, x, row.pos, d, row.request, row.out)
        if d > 0 and draft.drafter is not None:
            metrics.record_round(draft.drafter, draft.ngram)
        if draft.final is not None:
            metrics.draft_calls += 1 if draft.calls is None else draft.calls
            return Proposal(draft.tokens, [0], draft=draft, final=draft.final)
        width = draft.tokens.shape[1]
        if width:
            metrics.draft_calls += width if draft.calls is None else draft.calls
        return Proposal(
            draft.tokens, [width], draft.q, [draft.copied], [draft.drafter], draft=draft
        )

    def verify(self, runner, rows, x, proposal, metrics) -> torch.Tensor:
        pos, request = rows[0].pos, rows[0].request
        if proposal.width == 0:
            metrics.full_calls += 1
            return self.drafter.target(runner, x, pos)  # [1, 1, V]
        return self.drafter.verify(runner, x, pos, proposal.draft, request)  # [1, d+1, V]

    def accept(self, proposal, logits, requests):
        if logits.device.type == "cpu":  # the batch's acceptance, which syncs a row anyway
            return super().accept(proposal, logits, requests)
        # on an accelerator: the device ops, and one host sync for k, the next token and the
        # drafts together (the cache lengths are Python ints, the stop rule reads the tokens);
        # the next x stays on the device
        (request,) = requests
        if proposal.width == 0:
            token = choose(logits[:, -1], request)  # [1, 1]
            return [[int(token.reshape(-1)[0])]], [0], token
        drafts, draft = proposal.tokens, proposal.draft
        q = point_mass(drafts, logits.shape[-1], request) if draft.copied else draft.q
        n, nxt = accept(drafts, q, logits, request)  # [1], [1]
        k, next_token, *drafted = torch.cat([n, nxt, drafts[0]]).tolist()
        return [[*drafted[:k], next_token]], [k], nxt.view(1, 1)

    def accepted(self, runner, rows, proposal, kept, metrics, seconds) -> None:
        (k,) = kept
        # rows[0].pos is still the round's start: Decode moves it after this
        self.drafter.accepted(runner, rows[0].pos, k)
        if proposal.width:
            metrics.record_verify(proposal.width, k)
            rows[0].drafted += proposal.width
            rows[0].kept += k


def speculative_loop(
    runner: StageRunner,
    prompt: torch.Tensor,
    request: DecodeRequest,
    metrics: DecodeMetrics,
    num_speculations: int,
    drafter: Drafter,
    out: Output | None = None,
) -> list[int]:
    """Draft-then-verify decoding of one sequence: a :class:`Decode` of one row whose rounds
    ``drafter`` proposes and verifies (:class:`OneRow`). ``out``: the Output to collect into
    (a drafter that reads the text so far holds it; None: a fresh one). The caller gives the
    streamer its prompt and ``end()`` (``decode.decode``)."""
    out = Output(request) if out is None else out
    decode = Decode(runner, metrics, OneRow(drafter, num_speculations), streams=False)
    decode.start(prompt, [0], [request], [out])
    decode.run()
    return out.tokens


def run_drafter(
    runner: StageRunner,
    prompt: torch.Tensor,
    request: DecodeRequest,
    metrics: DecodeMetrics,
    num_speculations: int,
    drafter: Drafter,
    first: FirstDrafter | None = None,
) -> list[int]:
    """:func:`speculative_loop` over ``drafter``, with ``first`` tried before it each round."""
    out = Output(request)
    if first is not None:
        drafter = first.wrap(drafter, prompt, out)
    return speculative_loop(runner, prompt, request, metrics, num_speculations, drafter, out)


def self_speculative(
    runner: StageRunner,
    prompt: torch.Tensor,
    request: DecodeRequest,
    metrics: DecodeMetrics,
    num_speculations: int,
    drafter: DraftFn = draft,
    name: str = "layerskip",
    first: FirstDrafter | None = None,
) -> list[int]:
    """LayerSkip self-speculative decoding: draft with layers < E, verify with the rest.

    ``drafter`` makes the drafts (layers < E and the exit head by default; Kangaroo passes its
    adapter's dynamic-length drafter); its rounds count as ``name`` in ``drafter_rounds``.
    ``first``: a drafter tried before it each round (``lookup=True``). Nothing but the KV
    cache outlives a round (the exit hidden states go from the draft to the verify of the same
    round), so a round of another drafter verified by the ``full`` stage, which writes every
    slot (an adapter's too), leaves the next round what its own round would."""
    own = ExitDrafter(drafter, name)
    return run_drafter(runner, prompt, request, metrics, num_speculations, own, first)
