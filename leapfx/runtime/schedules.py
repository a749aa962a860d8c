"""Decode schedules: autoregressive, early exit, and self-speculative (LayerSkip sec. 4.3).

Each schedule is a short loop over the stage calls of a StageRunner (``full``, ``draft``,
``verify``), in the spirit of gpt-fast's ``generate.py``; token choice and acceptance are the
pure functions of ``sampling`` and ``verify``, and counts go to a DecodeMetrics recorder.

Positions: after prefill of an n-token prompt the cache holds positions 0..n-1 and the first
new token x sits at position n, not yet in the cache. A self-speculative round drafts d tokens
from x (the draft stage writes lower-layer KV for positions n..n+d-1 and returns their exit
hidden states), then one verify call runs the lower layers on the last draft (position n+d) and
the upper layers on positions n..n+d, giving d + 1 target distributions. With k drafts accepted
the cache is cropped to n + k + 1 (O(1)) and the emitted correction/bonus token becomes the next x.

Host syncs (a cost on a GPU): acceptance runs on the device (the ``leapfx::greedy_accept`` /
``leapfx::speculative_accept`` ops: Triton on CUDA, the rules of ``verify`` elsewhere) and the
next x stays a device tensor. A round syncs once, reading k, the next token and the drafts
together: the cache lengths the next round writes at are Python ints, and the stop rule (EOS,
max_new_tokens) looks at the tokens. Fixed-length drafting does not sync inside the draft loop;
dynamic drafting (threshold > 0) syncs once per draft to decide whether to stop.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from .metrics import DecodeMetrics
from .processing import Processing
from .runner import StageRunner
from .sampling import SamplingParams, probs


@dataclass(frozen=True)
class DecodeRequest:
    """What to generate: stop conditions and how tokens are chosen."""

    max_new_tokens: int
    eos_token_ids: frozenset[int]
    sampling: SamplingParams
    generator: torch.Generator | None = None
    # Teacher forcing, for lossy schedules (``agreement``): emit teacher_tokens[i] as the i-th
    # new token instead of the schedule's own choice, and count whether the two agree. The
    # schedule decides everything else (exits, cache state) as it would on its own.
    teacher_tokens: tuple[int, ...] | None = None
    # HF's streamer protocol (``put(tensor)``/``end()``, e.g. ``transformers.TextStreamer``):
    # each group of tokens the schedule emits is put as one 1-D tensor when it is emitted.
    streamer: Any | None = None
    # HF logits processors and stopping criteria of the call (``processing``); None when the
    # call has none beyond what ``sampling`` replays and nothing records scores.
    processing: Processing | None = None


class Output:
    """Collects new tokens; stops at the first EOS or at max_new_tokens.

    Every schedule emits through ``extend``, so the stop rule and the streamer see each token
    once, in order, whichever schedule made it."""

    def __init__(self, request: DecodeRequest) -> None:
        self.request = request
        self.tokens: list[int] = []
        self.done = False

    @property
    def remaining(self) -> int:
        return self.request.max_new_tokens - len(self.tokens)

    def extend(self, tokens: list[int], logits: torch.Tensor | None = None) -> None:
        """Emit ``tokens`` in order; ``logits`` [m, V]: the logits each was chosen from (what
        ``output_scores``/``output_logits`` and stopping criteria read)."""
        first = len(self.tokens)
        processing = self.request.processing
        for i, t in enumerate(tokens):
            if self.done:
                break
            self.tokens.append(t)
            if t in self.request.eos_token_ids or self.remaining <= 0:
                self.done = True
            if processing is not None:
                row = None if logits is None else logits[i : i + 1]
                self.done = processing.extend(t, row) or self.done
        streamer = self.request.streamer
        if streamer is not None and len(self.tokens) > first:
            streamer.put(torch.tensor(self.tokens[first:]))  # [m]: this group's new tokens


def active(request: DecodeRequest) -> Processing | None:
    """The call's processors when any beyond the replayed warpers apply, else None."""
    processing = request.processing
    return processing if processing is not None and processing.active else None


def choose(
    logits: torch.Tensor, request: DecodeRequest, drafts: torch.Tensor | None = None
) -> torch.Tensor:
    """Next token [1, 1] from logits [1, V] after the emitted tokens (and ``drafts`` [1, i]
    drafted since): argmax, or a draw from HF's warped distribution; with processors, of the
    processed scores."""
    processing = active(request)
    if processing is not None:
        scores = processing.scores(logits, drafts)  # [1, V], warped too when sampling
        if not request.sampling.do_sample:
            return scores.argmax(dim=-1, keepdim=True)
        p = torch.softmax(scores, dim=-1)
    elif not request.sampling.do_sample:
        return logits.argmax(dim=-1, keepdim=True)  # [1, 1]
    else:
        p = probs(logits.float(), request.sampling)
    return torch.multinomial(p, 1, generator=request.generator)  # [1, 1]


def draft_probs(
    logits: torch.Tensor, request: DecodeRequest, drafts: torch.Tensor | None = None
) -> torch.Tensor:
    """A sampling drafter's distribution q [1, V] from its logits [1, V]: the one ``choose``
    draws from (processed, with processors, over the prefix and ``drafts`` so far)."""
    processing = active(request)
    if processing is not None:
        return torch.softmax(processing.scores(logits, drafts), dim=-1)
    return probs(logits.float(), request.sampling)


def _token(t: torch.Tensor) -> int:
    return int(t.reshape(-1)[0])


def teacher_force(
    token: torch.Tensor, out: Output, request: DecodeRequest, metrics: DecodeMetrics
) -> torch.Tensor:
    """The token [1, 1] to emit next: ``token`` itself, or under teacher forcing the teacher's
    token at this position (recording whether ``token`` agreed with it)."""
    teacher = request.teacher_tokens
    if teacher is None:
        return token
    forced = teacher[len(out.tokens)]
    metrics.record_agreement(_token(token) == forced)
    return torch.full_like(token, forced)


def autoregressive(
    runner: StageRunner, prompt: torch.Tensor, request: DecodeRequest, metrics: DecodeMetrics
) -> list[int]:
    """One full-model call per token: the reference schedule (token-identical to HF greedy)."""
    layers = len(runner.layout.kinds)  # every decoder layer of the host

    def step(ids: torch.Tensor, start: int) -> Pass:
        return Pass(runner.full(ids, start), "full_calls", layers)

    return exit_loop(step, prompt, request, metrics)


def early_exit(
    runner: StageRunner,
    prompt: torch.Tensor,
    request: DecodeRequest,
    metrics: DecodeMetrics,
    exit_layer: int,
) -> list[int]:
    """LayerSkip sec. 4.2: every token from the exit head after layer E = ``exit_layer`` (lossy)."""

    def step(ids: torch.Tensor, start: int) -> Pass:
        return Pass(runner.draft(ids, start)[0], "draft_calls", exit_layer)

    return exit_loop(step, prompt, request, metrics)


@dataclass(frozen=True)
class Pass:
    """One call of a token-at-a-time decode (``exit_loop``): its ``logits`` [1, S, V] (the
    last row's choose the token), the metrics counter it adds one to (``full_calls``,
    ``draft_calls``), the decoder layers it ran, and ``token`` [1, 1] where the pass chose it
    itself (SpecEE's exit decision; None: ``choose`` on the logits)."""

    logits: torch.Tensor
    counter: str
    layers: int
    token: torch.Tensor | None = None


def exit_loop(
    step: Callable[[torch.Tensor, int], Pass],
    prompt: torch.Tensor,
    request: DecodeRequest,
    metrics: DecodeMetrics,
) -> list[int]:
    """The one loop of every decode that emits a token a call (autoregressive, and the lossy
    early exits: LayerSkip's, M2R2's, SpecEE's): ``step(prompt, 0)`` prefills, then
    ``step(token [1, 1], position)`` a token at a time, each :class:`Pass` choosing (or
    carrying) the next token, under teacher forcing where the request has it."""
    out = Output(request)
    one = step(prompt, 0)
    pos = prompt.shape[1]
    while True:
        token = one.token if one.token is not None else choose(one.logits[:, -1], request)
        token = teacher_force(token, out, request, metrics)
        setattr(metrics, one.counter, getattr(metrics, one.counter) + 1)
        metrics.record_layers(one.layers)
        out.extend([_token(token)], one.logits[0, -1:])
        if out.done:
            return out.tokens
        one = step(token, pos)
        pos += 1


def requests_of(request: DecodeRequest | Sequence[DecodeRequest], rows: int) -> list[DecodeRequest]:
    """One request a row: ``request`` for every row, or the per-row list itself."""
    if isinstance(request, DecodeRequest):
        return [request] * rows
    if len(request) != rows:
        raise ValueError(f"requests: {len(request)} for {rows} rows; allowed: one a row")
    return list(request)


def shared_request(request: DecodeRequest | Sequence[DecodeRequest]) -> DecodeRequest | None:
    """The one request every row shares (``request`` itself, or a list of the same one), or
    None where rows have their own: what decides whether a batch's tokens are chosen at once
    or a row at a time."""
    if isinstance(request, DecodeRequest):
        return request
    one = request[0]
    return one if all(r is one for r in request) else None


def draw(
    logits: torch.Tensor,
    request: DecodeRequest | Sequence[DecodeRequest],
    drafts: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A drafter's token a row [B, 1] from its logits [B, V], and under sampling the
    distribution q [B, V] it was drawn from (``draft_probs``; None when every row is greedy:
    greedy drafts are the raw argmax, the verify applies the processors). ``request``: one for
    every row, or one a row (a batch whose rows have their own sampling, generator or
    processors: drawn a row at a time, in order); ``drafts`` [B, i]: drafted this round so far.

    Every drafting loop chooses its tokens here, so a drafter's q is always the processed
    distribution the verify compares with."""
    one = shared_request(request)
    if one is not None:
        if not one.sampling.do_sample:
            return logits.argmax(dim=-1, keepdim=True), None  # no host sync
        if logits.shape[0] == 1 or active(one) is None:
            q = draft_probs(logits, one, drafts)  # [B, V]
            return torch.multinomial(q, 1, generator=one.generator), q
    rows = [one] * logits.shape[0] if one is not None else list(request)
    tokens, qs = [], []
    for b, r in enumerate(rows):
        token, q = draw(logits[b : b + 1], r, None if drafts is None else drafts[b : b + 1])
        tokens.append(token)
        qs.append(q)
    token = torch.cat(tokens)
    if all(q is None for q in qs):
        return token, None
    # a greedy row's q is never read (its acceptance is greedy): its point mass stands in
    V = logits.shape[-1]
    fill = [
        q if q is not None else torch.nn.functional.one_hot(t[0], V)[None].float()
        for q, t in zip(qs, tokens, strict=True)
    ]
    return token, torch.cat(fill)


def draft_steps(
    step: Callable[[torch.Tensor, int], torch.Tensor],
    x: torch.Tensor,
    d: int,
    request: DecodeRequest | Sequence[DecodeRequest],
    *,
    threshold: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor | None, list[int]]:
    """The drafting loop of every drafter that drafts a token at a time (an exit head, a
    layer-skipped stage, EAGLE's head, M2R2's fast stream; one row or a batch's).

    ``step(token [B, 1], i)`` runs the drafter's i-th call on the previous token and returns
    its logits [B, V]; ``x`` [B, 1]: each row's newest token. Returns the drafts [B, d'], under
    sampling their distributions q [B, d', V] (``draw``), and each row's valid count. With
    ``threshold`` 0 every row drafts d (d' = d; greedy tokens stay on the device: no host
    sync). With ``threshold`` > 0 (Kangaroo eq. 4, EAGLE's confidence stop) a row stops after
    its first draft whose top-1 probability is <= threshold (that draft is kept: its valid
    count), one host sync a step, and the loop ends once every row has stopped (for one row:
    d' is its count)."""
    tokens, qs = [], []
    valid = [d] * x.shape[0]
    token = x
    for i in range(d):
        logits = step(token, i)  # [B, V]
        token, q = draw(logits, request, _drafted(tokens))
        tokens.append(token)
        if q is not None:
            qs.append(q)
        if threshold > 0 and i + 1 < d:
            dist = q if q is not None else torch.softmax(logits.float(), dim=-1)
            low = (dist.max(dim=-1).values <= threshold).tolist()  # host sync: the stop rule
            valid = [i + 1 if stop and v == d else v for v, stop in zip(valid, low, strict=True)]
            if all(v <= i + 1 for v in valid):
                break
    return torch.cat(tokens, dim=1), (torch.stack(qs, dim=1) if qs else None), valid


def draft(
    runner: StageRunner,
    x: torch.Tensor,
    start: int | list[int],
    d: int,
    request: DecodeRequest | Sequence[DecodeRequest],
    *,
    threshold: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Draft up to d tokens autoregressively from tokens x [B, 1] at ``start`` with the draft
    stage (``draft_steps``): the exit head (LayerSkip, Kangaroo's adapter), or a batch's
    layer-skipped stage. ``start``: the runner's (an int for one sequence; over a ragged cache,
    each row's column, a batch's rows each with its own ``request``).

    Returns draft tokens [B, d'], their exit hidden states [B, d', H] (the exit-query cache for
    positions start..start+d'-1; None where the stage returns none) and, when sampling, the
    draft distributions q [B, d', V]. ``threshold``: ``draft_steps``' stop rule (0:
    LayerSkip's d drafts, no host sync).
    """
    ragged = runner.ragged
    if (
        not ragged
        and threshold <= 0
        and not request.sampling.do_sample
        and runner.chain_length() == d
    ):
        # stages that run the d greedy steps as one call (a ``draft_chain``: compiled, ONNX or
        # eager kernel stages; one call's overhead a round instead of d); the same tokens and
        # hidden states
        tokens, hidden = runner.draft_chain(x, start)
        return tokens, hidden, None
    hidden: list[torch.Tensor] = []

    def step(token: torch.Tensor, i: int) -> torch.Tensor:
        # logits: [B, 1, V], h: [B, 1, H] (None: the stage gives no exit states)
        logits, h = runner.draft(token, [s + i for s in start] if ragged else start + i)
        if h is not None:
            hidden.append(h)
        return logits[:, -1]

    tokens, q, _ = draft_steps(step, x, d, request, threshold=threshold)
    exit_hidden = torch.cat(hidden, dim=1) if len(hidden) == tokens.shape[1] else None
    return tokens, exit_hidden, q


def _drafted(tokens: list[torch.Tensor]) -> torch.Tensor | None:
    """A drafter's tokens so far as [B, i] (None before the first)."""
    return torch.cat(tokens, dim=1) if tokens else None


def accept(
    drafts: torch.Tensor,
    q: torch.Tensor | None,
    target_logits: torch.Tensor,
    request: DecodeRequest,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Accepted draft count n [1] and the next token [1] (correction or bonus), on the device.

    No host sync: the ``leapfx`` acceptance ops (``leapfx.kernels``) compute the rules of
    ``leapfx.kernels.reference``. Sampling draws ``u_accept`` [1, d] then ``u_sample`` [1] from the
    request's generator (as ``reference.speculative_accept_random`` does). With processors the
    target rows are first processed over their prefixes (``Processing.rows``: a host loop).
    """
    from .. import kernels  # on first use: it imports Triton where installed

    processing = active(request)
    if processing is not None:
        scores = processing.rows(target_logits, drafts)  # [1, d+1, V], warped when sampling
        if not request.sampling.do_sample:
            return kernels.greedy_accept(drafts, scores)
        p = torch.softmax(scores, dim=-1)
    elif not request.sampling.do_sample:
        return kernels.greedy_accept(drafts, target_logits)
    else:
        p = probs(target_logits.float(), request.sampling)  # [1, d+1, V]
    B, d = drafts.shape
    kw = dict(generator=request.generator, device=p.device, dtype=p.dtype)
    u_accept = torch.rand((B, d), **kw)  # [1, d]
    u_sample = torch.rand((B,), **kw)  # [1]
    return kernels.speculative_accept(drafts, q, p, u_accept, u_sample)


def greedy_rule(drafted: list[int], targets: list[int]) -> int:
    """Greedy acceptance: how many of ``drafted`` equal the target's tokens ``targets`` (its
    argmax at each drafted position and one past), up to the first that does not."""
    k = 0
    while k < len(drafted) and drafted[k] == targets[k]:
        k += 1
    return k


def accept_rows(
    drafts: torch.Tensor,
    valid: list[int],
    q: torch.Tensor | None,
    copied: list[bool],
    target_logits: torch.Tensor,
    requests: Sequence[DecodeRequest],
) -> tuple[list[list[int]], list[int]]:
    """A round's acceptance for every row, on the host: each row's emitted tokens (its kept
    drafts and the target's token after them) and kept count.

    ``drafts`` [B, w]: row b's first ``valid[b]`` are its drafts (the rest filler, never
    kept); ``q`` [B, w, V]: their draft distributions under sampling (a ``copied`` row's is a
    point mass, built here); ``target_logits`` [B, w + 1, V]; ``requests``: one a row. Greedy
    rows without processors: ``greedy_rule`` over the targets' argmax (one host sync for the
    batch); every other row: ``accept`` (rejection sampling, processors) over its own drafts,
    rows in order."""
    plain = [not r.sampling.do_sample and active(r) is None for r in requests]
    targets = target_logits.argmax(dim=-1).tolist() if any(plain) else None  # [B, w + 1]
    emitted, kept = [], []
    for b, (v, request) in enumerate(zip(valid, requests, strict=True)):
        if plain[b]:
            drafted = drafts[b, :v].tolist()
            k = greedy_rule(drafted, targets[b])
            emitted.append([*drafted[:k], targets[b][k]])
            kept.append(k)
            continue
        row = drafts[b : b + 1, :v]
        if not request.sampling.do_sample or v == 0:
            row_q = None
        elif copied[b]:
            row_q = point_mass(row, target_logits.shape[-1], request)
        else:
            row_q = q[b : b + 1, :v]
        if v == 0:
            token = choose(target_logits[b, :1], request)
            emitted.append([_token(token)])
            kept.append(0)
            continue
        n, nxt = accept(row, row_q, target_logits[b : b + 1, : v + 1], request)
        k = int(n)
        emitted.append([*row[0, :k].tolist(), int(nxt)])
        kept.append(k)
    return emitted, kept


# The exit-layer drafting function LayerSkip and Kangaroo pass (``draft`` above):
# (runner, x [1, 1], start, max drafts, request) -> (drafts [1, d], exit hidden [1, d, H],
# q [1, d, V] or None); d may stop short of the maximum (Kangaroo's eta rule).
DraftFn = Callable[
    [StageRunner, torch.Tensor, int, int, DecodeRequest],
    tuple[torch.Tensor, torch.Tensor, torch.Tensor | None],
]


@dataclass(frozen=True)
class Draft:
    """One round's proposal (a named record: what the loop and the drafter's own verify read).

    ``tokens`` [1, d]: the drafts (d = 0: none; the round is one plain step). ``q`` [1, d, V]:
    their draft distributions under sampling (None when greedy, and for ``copied`` drafts,
    whose distribution is a point mass the loop builds once V is known). ``drafter``: who
    drafted, counted in ``drafter_rounds`` (None: not counted); ``ngram``: prompt lookup's
    matched n. ``state``: what this drafter's ``verify`` reads (LayerSkip's exit hidden states,
    SpecEE's per-layer states). ``calls``: draft calls the round made (None: one a draft).
    ``final``: (token [1, 1], logits [1, V]) of a round that emits a token without a verify
    (SpecEE: a first pass that ran every layer over an exact context)."""

    tokens: torch.Tensor
    q: torch.Tensor | None = None
    drafter: str | None = None
    ngram: int = 0
    state: Any = None
    copied: bool = False
    calls: int | None = None
    final: tuple[torch.Tensor, torch.Tensor] | None = None


def no_draft(x: torch.Tensor, drafter: str | None = None, ngram: int = 0) -> Draft:
    """A round with nothing drafted (tokens [1, 0] on x's device)."""
    return Draft(x[:, :0], drafter=drafter, ngram=ngram)


class Drafter:
    """What ``rounds.speculative_loop`` (``rounds.OneRow``) asks of a drafter; one object per
    decode, so it may hold the state one round leaves the next (EAGLE's last hidden state).

    ``target`` is the full model on a run of tokens (prefill, a plain step, the verify of
    copied drafts); ``propose`` drafts up to d tokens from x at ``start``; ``verify`` gives
    the d + 1 target distributions of a round it drafted (by default one ``target`` call over
    [x, drafts]); ``accepted`` hears how many drafts the round kept (k; 0 after a plain step),
    after the cache was cropped to start + k + 1.

    What the adaptive drafter (``adaptive.AdaptiveDrafter``) reads of the drafter it chooses
    for: ``exploring``, the drafter is measuring choices of its own (swift's online skip-set
    search) and is given every round, at full length; ``idle``, it has found nothing worth
    drafting (no skip set pays) and is no choice."""

    name: str | None = None
    exploring: bool = False
    idle: bool = False

    def prefill(self, runner: StageRunner, prompt: torch.Tensor) -> torch.Tensor:
        """Logits [1, n, V] of the prompt [1, n]; fills every cache layer the drafter reads."""
        return self.target(runner, prompt, 0)

    def target(
        self, runner: StageRunner, ids: torch.Tensor, start: int, key: str | None = None
    ) -> torch.Tensor:
        """The full model on ``ids`` [1, S] at start..: logits [1, S, V]."""
        return runner.full(ids, start, key=key)

    def propose(
        self,
        runner: StageRunner,
        x: torch.Tensor,
        start: int,
        d: int,
        request: DecodeRequest,
        out: Output,
    ) -> Draft:
        """At most d drafts after token x [1, 1] at ``start`` (``out``: the text so far)."""
        return no_draft(x)

    def verify(
        self, runner: StageRunner, x: torch.Tensor, start: int, draft: Draft, request: DecodeRequest
    ) -> torch.Tensor:
        """Target logits [1, d + 1, V] over [x, drafts] at start..start+d."""
        return self.target(runner, torch.cat([x, draft.tokens], dim=1), start, key="verify")

    def accepted(self, runner: StageRunner, start: int, k: int) -> None:
        """The round from ``start`` kept k drafts (the cache holds start + k + 1 positions)."""


def point_mass(drafts: torch.Tensor, vocab: int, request: DecodeRequest) -> torch.Tensor | None:
    """A copied draft's distribution q [1, d, V] under sampling (a point mass on each draft,
    so rejection sampling keeps y with probability p(y)); None when greedy."""
    if not request.sampling.do_sample:
        return None
    return torch.nn.functional.one_hot(drafts, vocab).to(torch.float32)


class ExitDrafter(Drafter):
    """LayerSkip's drafter (Kangaroo's with its adapter's stop rule): layers < E and the exit
    head draft; the verify pass runs the lower layers on the last draft and the upper layers
    on the round's exit hidden states (``StageRunner.verify``)."""

    def __init__(self, draft_fn: DraftFn, name: str) -> None:
        self.draft_fn, self.name = draft_fn, name

    def propose(self, runner, x, start, d, request, out) -> Draft:
        if d == 0:
            return no_draft(x)
        drafts, exit_hidden, q = self.draft_fn(runner, x, start, d, request)
        return Draft(drafts, q, self.name, state=exit_hidden)

    def verify(self, runner, x, start, draft, request) -> torch.Tensor:
        # Lower layers for the last draft, upper layers for x and every draft: [1, d+1, V].
        return runner.verify(draft.tokens[:, -1:], draft.state, start)


class FirstDrafter(Protocol):
    """A drafter each round tries before the recipe's own (``lookup.LookupFirst``: prompt
    lookup, a drafting recipe's ``lookup=True``): ``wrap(own, prompt, out)`` is the drafter
    that drafts with it where it has drafts and with ``own`` where it has none; it reads the
    text so far from ``out``, the loop's Output."""

    def wrap(self, own: Drafter, prompt: torch.Tensor, out: Output) -> Drafter: ...
