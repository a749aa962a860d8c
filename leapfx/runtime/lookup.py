"""Prompt-lookup decoding: drafts copied from earlier text, verified by the full model.

Training-free speculation (HF ``PromptLookupCandidateGenerator``, vLLM's ``ngram`` proposer):
the last n tokens of the text so far (prompt + generated) are looked up in the earlier text;
the tokens that followed their most recent earlier occurrence are the drafts. n runs from
``max_ngram`` down to ``min_ngram`` and the first n with a match wins (a longer match is
likelier to continue the same way). Drafting costs a dictionary lookup, no model call.

HF searches the whole text each round and takes the *first* (oldest) match; here an
:class:`NgramIndex` maps every n-gram to the start of its *latest* occurrence that has a
continuation, updated as tokens arrive (O(max_ngram) a token, O(max_ngram) a lookup), and the
most recent match is taken: in code and chat the nearest repetition is the likelier one to
continue (a loop body, the line just quoted). Where the match's continuation runs into the end
of the text (the match overlaps the suffix: a repeating run), it goes on with the text it has
just produced, ``ext[i + n + j]`` over the extended text: the run keeps repeating with its
period, so a run of one repeated token drafts d of it rather than one.

A round, with the newest token x at position p (not yet in the cache)::

    propose: y_1..y_d' from the index (d' <= d; d' = 0 without a match)
    verify:  one ``full`` call over [x, y_1..y_d'] at p..p+d' -> d' + 1 target distributions
             (the same stage as prefill: any length, every backend)
    accept:  ``rounds.speculative_loop``'s acceptance; under sampling the draft
             distribution is a point mass on y_i (q one-hot), so y_i is kept with probability
             p(y_i) and a rejection resamples from p with y_i removed: lossless.

Without a match the round is one plain full step (d' = 0). One KV cache, cropped after each
round; the only host sync is the loop's one a round.

A drafting recipe's ``lookup=True`` (:class:`LookupFirst`) puts the same drafter before its
own: a round with a match verifies it as above, a round without one is the recipe's own round
(its drafter, its verify). The full call writes every layer's keys for the positions it runs,
and every slot the recipe adds that its ``full`` stage fills (Kangaroo's adapter), so after the
crop the cache is what the recipe's own round would have left. EAGLE verifies a match with its
``target`` call instead, which also fills the head's slot and returns the last hidden state
its next round reads.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .metrics import DecodeMetrics
from .rounds import speculative_loop
from .runner import StageRunner
from .schedules import (
    DecodeRequest,
    Draft,
    Drafter,
    Output,
    no_draft,
)


@dataclass(frozen=True)
class Drafts:
    """A drafter's proposal for one round (STYLE 11: a named record, not a tuple).

    ``tokens``: the draft token ids (host ints, possibly none); ``drafter``: who drafted them
    ("none" when nobody did); ``ngram``: the matched n for prompt lookup (0: no match)."""

    tokens: tuple[int, ...]
    drafter: str
    ngram: int = 0


def brute_force_match(
    text: Sequence[int], max_ngram: int, min_ngram: int, d: int
) -> tuple[tuple[int, ...], int]:
    """The reference rule, by scanning: for n = max_ngram..min_ngram, the latest i < len - n
    with text[i:i+n] == text[-n:]; returns (the d tokens that followed it, n), read over the
    text extended by the drafts themselves, or ((), 0) without a match."""
    L = len(text)
    for n in range(max_ngram, min_ngram - 1, -1):
        if n >= L:
            continue  # the suffix needs an earlier occurrence
        tail = list(text[L - n :])
        for i in range(L - n - 1, -1, -1):
            if list(text[i : i + n]) == tail:
                return _continue(text, i + n, d), n
    return (), 0


def _continue(text: Sequence[int], start: int, d: int) -> tuple[int, ...]:
    """d tokens from ``start`` < len(text) on, past the end reading the ones just produced."""
    ext = list(text[start:])
    for j in range(d - len(ext)):
        ext.append(ext[j])
    return tuple(ext[:d])


class NgramIndex:
    """Every n-gram (min_ngram <= n <= max_ngram) of a growing text mapped to the start of its
    latest occurrence that is followed by at least one token.

    >>> idx = NgramIndex(max_ngram=2, min_ngram=1); idx.extend([5, 6, 7, 5, 6])
    >>> idx.match(4)   # the last 2 tokens (5, 6) occurred at 0, followed by 7, 5, 6 (, 7)
    ((7, 5, 6, 7), 2)
    """

    def __init__(self, max_ngram: int, min_ngram: int = 1) -> None:
        assert 1 <= min_ngram <= max_ngram
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.text: list[int] = []
        self._latest: list[dict[tuple[int, ...], int]] = [{} for _ in range(max_ngram + 1)]

    def extend(self, tokens: Sequence[int]) -> None:
        """Append ``tokens``; each n-gram that now has a following token is indexed."""
        text = self.text
        for t in tokens:
            text.append(int(t))
            end = len(text) - 1  # the n-grams ending just before the new token gain a follower
            for n in range(self.min_ngram, self.max_ngram + 1):
                if end >= n:
                    self._latest[n][tuple(text[end - n : end])] = end - n

    def match(self, d: int) -> tuple[tuple[int, ...], int]:
        """Up to ``d`` tokens that followed the latest earlier occurrence of the text's last n
        tokens, largest n first; ((), 0) without a match."""
        text = self.text
        for n in range(self.max_ngram, self.min_ngram - 1, -1):
            if n > len(text):
                continue
            i = self._latest[n].get(tuple(text[len(text) - n :]))
            if i is not None:
                return _continue(text, i + n, d), n
        return (), 0


class PromptLookup:
    """The n-gram drafter: ``propose(generated, d)`` drafts from prompt + generated text.

    ``generated`` is the decode's Output token list (its last token is x, the token the
    round drafts after); the index takes the tokens it has not seen yet."""

    name = "lookup"

    def __init__(self, prompt: Sequence[int], max_ngram: int, min_ngram: int) -> None:
        self.index = NgramIndex(max_ngram, min_ngram)
        self.index.extend(prompt)
        self._prompt_len = len(prompt)

    def _catch_up(self, generated: Sequence[int]) -> None:
        seen = len(self.index.text) - self._prompt_len
        self.index.extend(generated[seen:])

    def propose(self, generated: Sequence[int], d: int) -> Drafts:
        self._catch_up(generated)
        tokens, n = self.index.match(d)
        return Drafts(tokens, self.name if tokens else "none", n)


def draft_tokens(proposal: Drafts, x: torch.Tensor) -> torch.Tensor:
    """The proposal's tokens as drafts [1, d] on x's device, in x's dtype."""
    return torch.tensor([proposal.tokens], dtype=x.dtype, device=x.device)


def copied_draft(proposal: Drafts, x: torch.Tensor) -> Draft:
    """A text drafter's proposal as the loop's Draft (its tokens copied, q a point mass)."""
    if not proposal.tokens:
        return no_draft(x, proposal.drafter, proposal.ngram)
    return Draft(draft_tokens(proposal, x), None, proposal.drafter, proposal.ngram, copied=True)


class TextDrafter(Drafter):
    """A drafter that reads the text so far (``source.propose(generated, d) -> Drafts``:
    :class:`PromptLookup`); each round verified by one full-model call over [x, drafts] (the
    same stage as prefill: any length, every backend)."""

    def __init__(self, source) -> None:
        self.source = source

    def propose(self, runner, x, start, d, request, out) -> Draft:
        if d == 0:
            return no_draft(x)
        return copied_draft(self.source.propose(out.tokens, d), x)


class LookupThen(Drafter):
    """Prompt lookup where the text so far has a match, else ``own`` (the recipe's drafter).

    A lookup round is verified by ``own.target`` over [x, drafts]: the full model, which
    writes every layer's keys and every slot the recipe adds that its full stage fills
    (Kangaroo's adapter; EAGLE's ``target`` also fills the head's slot and keeps the hidden
    state its next round reads), so after the crop the cache is what ``own``'s round would
    have left. ``accepted`` goes to ``own`` after either kind of round."""

    def __init__(self, lookup: PromptLookup, own: Drafter) -> None:
        self.lookup, self.own = lookup, own
        self.name = own.name

    def prefill(self, runner, prompt):
        return self.own.prefill(runner, prompt)

    def target(self, runner, ids, start, key=None):
        return self.own.target(runner, ids, start, key)

    def propose(self, runner, x, start, d, request, out) -> Draft:
        if d == 0:
            return no_draft(x)
        proposal = self.lookup.propose(out.tokens, d)
        if not proposal.tokens:
            return self.own.propose(runner, x, start, d, request, out)
        return copied_draft(proposal, x)

    def verify(self, runner, x, start, draft, request):
        if draft.copied:
            return self.own.target(runner, torch.cat([x, draft.tokens], dim=1), start, "verify")
        return self.own.verify(runner, x, start, draft, request)

    def accepted(self, runner, start, k):
        self.own.accepted(runner, start, k)


@dataclass(frozen=True)
class LookupFirst:
    """Prompt lookup before a recipe's own drafter (a drafting recipe's ``lookup=True``).

    Each round looks the text so far (prompt + emitted tokens) up as :class:`PromptLookup`
    does; with a match its drafts are verified by one full-model call over [x, drafts] and the
    round counts as "lookup", without one the recipe's own round runs (and counts as the
    recipe's drafter). Lossless either way: every round is verified by the full model
    (:class:`LookupThen`)."""

    max_ngram: int
    min_ngram: int = 1

    def drafter(self, prompt: torch.Tensor) -> PromptLookup:
        """A PromptLookup over ``prompt`` [1, n]."""
        return PromptLookup(prompt[0].tolist(), self.max_ngram, self.min_ngram)

    def wrap(self, own: Drafter, prompt: torch.Tensor, out: Output) -> Drafter:
        """The drafter that tries lookup first, then ``own``."""
        return LookupThen(self.drafter(prompt), own)


def lookup(
    runner: StageRunner,
    prompt: torch.Tensor,
    request: DecodeRequest,
    metrics: DecodeMetrics,
    num_speculations: int,
    max_ngram: int,
    min_ngram: int,
) -> list[int]:
    """Prompt-lookup decoding: n-gram drafts of up to ``num_speculations`` tokens a round."""
    drafter = PromptLookup(prompt[0].tolist(), max_ngram, min_ngram)
    return drafted_loop(runner, prompt, request, metrics, num_speculations, drafter)


def drafted_loop(
    runner: StageRunner,
    prompt: torch.Tensor,
    request: DecodeRequest,
    metrics: DecodeMetrics,
    num_speculations: int,
    source,
) -> list[int]:
    """``speculative_loop`` over a text drafter (``propose(generated, d) -> Drafts``), each
    round verified by one full-model call."""
    metrics.num_speculations = num_speculations
    drafter = TextDrafter(source)
    return speculative_loop(runner, prompt, request, metrics, num_speculations, drafter)
