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
    accept:  ``schedules.speculative_loop``'s acceptance; under sampling the draft
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
from .runner import StageRunner
from .schedules import DecodeRequest, Output, Round, speculative_loop


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


def point_mass(drafts: torch.Tensor, vocab: int, request: DecodeRequest) -> torch.Tensor | None:
    """A copied draft's distribution q [1, d, V] under sampling (a point mass on each draft,
    so rejection sampling keeps y with probability p(y)); None when greedy."""
    if not request.sampling.do_sample:
        return None
    return torch.nn.functional.one_hot(drafts, vocab).to(torch.float32)


def verify_drafts(
    runner: StageRunner, x: torch.Tensor, pos: int, proposal: Drafts, request: DecodeRequest
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """One full call over [x, drafts] at pos..pos+d: (drafts [1, d], q [1, d, V] one-hot under
    sampling else None, target logits [1, d + 1, V]). With no drafts, a plain full step
    (drafts [1, 0], logits [1, 1, V]), timed as "full"; otherwise timed as "verify"."""
    if not proposal.tokens:
        return x[:, :0], None, runner.full(x, pos)  # [1, 0], [1, 1, V]
    drafts = draft_tokens(proposal, x)  # [1, d]
    logits = runner.full(torch.cat([x, drafts], dim=1), pos, key="verify")  # [1, d+1, V]
    return drafts, point_mass(drafts, logits.shape[-1], request), logits


@dataclass(frozen=True)
class LookupFirst:
    """Prompt lookup before a recipe's own drafter (a drafting recipe's ``lookup=True``).

    Each round looks the text so far (prompt + emitted tokens) up as :class:`PromptLookup`
    does; with a match its drafts are verified by one ``full`` call over [x, drafts]
    (:func:`verify_drafts`) and the round counts as "lookup", without one the recipe's own
    round runs (and counts as the recipe's drafter). Lossless either way: every round is
    verified by the full model. It composes with a recipe whose rounds leave nothing but the
    KV cache for the next one and whose ``full`` stage writes every slot its drafter reads
    (``schedules.speculative_loop``'s ``first``); EAGLE's loop, which carries the last hidden
    state, runs :meth:`drafter` itself and verifies with its ``target`` stage.
    """

    max_ngram: int
    min_ngram: int = 1

    def drafter(self, prompt: torch.Tensor) -> PromptLookup:
        """A PromptLookup over ``prompt`` [1, n]."""
        return PromptLookup(prompt[0].tolist(), self.max_ngram, self.min_ngram)

    def round(self, own: Round, prompt: torch.Tensor, out: Output, metrics: DecodeMetrics) -> Round:
        """The round that drafts by lookup where the text has a match, else runs ``own``."""
        drafter = self.drafter(prompt)

        def round_(runner, x, pos, d, request):
            proposal = drafter.propose(out.tokens, d)
            if not proposal.tokens:
                return own(runner, x, pos, d, request)  # it records its own drafter
            metrics.record_round(proposal.drafter, proposal.ngram)
            return verify_drafts(runner, x, pos, proposal, request)

        return round_


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
    drafter,
) -> list[int]:
    """``speculative_loop`` over a drafter that reads the text so far (``propose(generated,
    d) -> Drafts``), each round verified by one full-model call."""
    metrics.num_speculations = num_speculations
    out = Output(request)

    def round_(runner, x, pos, d, request):
        proposal = drafter.propose(out.tokens, d)
        metrics.record_round(proposal.drafter, proposal.ngram)
        return verify_drafts(runner, x, pos, proposal, request)

    return speculative_loop(runner, prompt, request, metrics, num_speculations, round_, out)
