"""EAGLE's chain decode schedule: the draft head proposes, the full model verifies (lossless).

Stages (``leapfx.passes.eagle_head.eagle_stages``):

- ``target``: every host layer, norm and head on a chunk, plus the head's fc + layer on the
  host's true features (so the head's cache layer is filled wherever the host runs); returns the
  logits and the pre-norm last-layer hidden states h of the chunk;
- ``head``: the draft head alone on (token x_t, h_{t-1}) -> (head logits, head state g_t).

A round, with the newest token x at position p (not yet in the cache), every cache layer -- the host
layers' and the head's -- holding positions 0..p-1, and h_{p-1} from the previous target call::

    draft:  y_1 from head(x, h_{p-1}) at p; y_{i+1} from head(y_i, g_{p+i-1}) at p+i (the head
            feeds its own state back). Stops after the first y_i whose top-1 probability is <=
            confidence_threshold, or at d = max_draft_tokens. Writes head KV for p..p+d-1.
    verify: crop the head's cache layer back to p (its draft KV came from its own g, not from h; the
            host's cache layers hold 0..p-1 anyway, so a plain crop(p) does it), then
            target on [x, y_1..y_d] at p..p+d with h_{p-1}: d+1 target distributions and the
            true h of every position; host and head KV for p..p+d, the head's now from h.
    accept: k drafts and a correction/bonus token z (``schedules.accept``: greedy prefix match
            or rejection sampling); crop every cache layer to p+k+1 (O(1)); h_{p+k} is the state the
            next round's first draft reads, z the token.

So the head always attends to KV computed from the host's true features for committed
positions (as EAGLE recomputes its KV of accepted tokens), and costs one head call per draft.

Host syncs: one per draft step when ``confidence_threshold`` > 0 (to decide whether to stop),
and one per round reading k, the next token and the drafts (as ``rounds.self_speculative``).

Helpers for other schedules (SpecEE takes its k = 4 candidates from the head's logits)::

    logits, g = head_step(runner, x, h_prev, start)     # [B, S, V], [B, S, D]
    logits, h = target_step(runner, ids, h_prev, start)  # [B, S, V], [B, S, D]

A batch runs the same drafter and helpers over a ragged runner (``batch.BatchDrafter``): each
row at its own columns, ``h`` a row each, the head's draft KV cropped by the batch's verify.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .metrics import DecodeMetrics
from .rounds import run_drafter
from .runner import StageRunner, Start
from .schedules import (
    DecodeRequest,
    Draft,
    Drafter,
    FirstDrafter,
    draft_steps,
    no_draft,
)


def head_step(
    runner: StageRunner, input_ids: torch.Tensor, hidden: torch.Tensor, start: Start
) -> tuple[torch.Tensor, torch.Tensor]:
    """The draft head on tokens ``input_ids`` [B, S] at positions start.. (a ragged runner's:
    each row's columns) reading ``hidden`` [B, S, D] (h_{t-1} of each token, or the head's own
    g); returns (logits [B, S, V], g [B, S, D]) and writes the head's cache layer for those
    positions."""
    # Timed as "draft" / "verify" (``runner.seconds``), the names the bench's cost ratios read.
    out = runner.chunk("head", input_ids, start, key="draft", hidden=hidden)
    return out["logits"], out["hidden"]


def target_step(
    runner: StageRunner,
    input_ids: torch.Tensor,
    prev_hidden: torch.Tensor | None,
    start: Start,
    key: str = "verify",
) -> tuple[torch.Tensor, torch.Tensor]:
    """The full model (and the head's KV from true features) on ``input_ids`` [B, S] at
    positions start..; ``prev_hidden`` [B, 1, D] is h_{start-1} (at 0: zeros, [B, 1, 1] or
    None). Returns (logits [B, S, V], h [B, S, D], pre-norm); at ``start`` 0 (a prompt) the
    logits are the last position's only, [1, 1, V] (``StageRunner.chunk``). Timed as ``key``."""
    out = runner.chunk("target", input_ids, start, key=key, prev_hidden=prev_hidden)
    return out["logits"], out["hidden"]


def draft_chain(
    runner: StageRunner,
    x: torch.Tensor,
    h_prev: torch.Tensor,
    start: Start,
    max_tokens: int,
    threshold: float,
    request: DecodeRequest | Sequence[DecodeRequest],
) -> tuple[torch.Tensor, torch.Tensor | None, list[int]]:
    """Draft up to ``max_tokens`` from tokens x [B, 1] at ``start`` (a ragged runner's: each
    row's column, each row its own ``request``) and h_{start-1} [B, 1, D].

    Returns draft tokens [B, d], when sampling their draft distributions q [B, d, V] (what
    rejection sampling compares with the target), and each row's valid count. With
    ``threshold`` > 0 a row stops drafting after its first token whose top-1 probability is
    <= threshold (that token is kept), and the head once every row has (``draft_steps``).
    """
    hidden = h_prev
    ragged = runner.ragged

    def step(token: torch.Tensor, i: int) -> torch.Tensor:
        nonlocal hidden
        at = [s + i for s in start] if ragged else start + i
        logits, hidden = head_step(runner, token, hidden, at)  # [B, 1, V], [B, 1, D]
        return logits[:, -1]

    return draft_steps(step, x, max_tokens, request, threshold=threshold)


class EagleDrafter(Drafter):
    """The draft head proposes (``draft_chain``); ``target`` is the full model with the head's
    KV from true features, and keeps the hidden states h of its last call: after a round that
    kept k drafts, h of position start + k is what the next round's first draft reads.

    One sequence's (``rounds.OneRow``) or a batch's rows' (``batch.BatchDrafter``, over a
    ragged runner): ``h`` [B, 1, D] is each row's pre-norm last-layer state of its newest kept
    token, ``keep`` and ``join`` follow the rows that stay and those that join."""

    name = "eagle"

    def __init__(self, threshold: float) -> None:
        self.threshold = threshold
        self.h: torch.Tensor | None = None  # [B, 1, D]; set by prefill
        self._hidden: torch.Tensor | None = None  # [B, S, D]: of the last target call

    def prefill(self, runner, prompt):
        """``target`` over the prompts [B, S] (a padded batch's rows each over its own tokens,
        so that its first token's h_{-1} is zeros, as a row alone gets): logits
        [B, 1 or S, V]."""
        lay = runner.layout
        zeros = torch.zeros(prompt.shape[0], 1, 1, dtype=lay.dtype, device=lay.device)  # h_{-1}
        out = runner.prefill("target", prompt, alone=True, prev_hidden=zeros)
        self._hidden = out["hidden"]
        self.h = self._hidden[:, -1:]  # h_{n-1}: [B, 1, D]
        return out["logits"]

    def target(self, runner, ids, start, key=None):
        logits, self._hidden = target_step(runner, ids, self.h, start, key or "verify")
        return logits

    def propose(self, runner, x, start, d, request, out) -> Draft:
        if d == 0:
            return no_draft(x)
        drafts, q, _ = draft_chain(runner, x, self.h, start, d, self.threshold, request)
        # The draft's head KV came from the head's own states; verify rewrites it from h.
        # Only the head's cache layer holds positions >= start, so this crops it alone.
        runner.cache.crop(start)
        return Draft(drafts, q, self.name)

    def accepted(self, runner, start, k):
        """The round kept k drafts (a ragged runner's rows: ``k[b]`` of row b): h is the
        target's state at the last kept position."""
        if runner.ragged:
            device = self._hidden.device
            rows = torch.arange(len(k), device=device)
            self.h = self._hidden[rows, torch.tensor(k, device=device)][:, None]
        else:
            self.h = self._hidden[:, k : k + 1]

    def keep(self, live: list[int]) -> None:
        """Only the rows ``live`` go on."""
        self.h = self.h[live]

    def join(self, other: EagleDrafter) -> None:
        """Append ``other``'s rows' states after these."""
        self.h = other.h if self.h is None or not len(self.h) else torch.cat([self.h, other.h])


def eagle(
    runner: StageRunner,
    prompt: torch.Tensor,
    request: DecodeRequest,
    metrics: DecodeMetrics,
    max_draft_tokens: int,
    confidence_threshold: float,
    first: FirstDrafter | None = None,
) -> list[int]:
    """EAGLE chain decoding: head drafts with dynamic length, the full model verifies.

    ``first`` (``lookup=True``): each round drafts by prompt lookup where the text so far has
    a match, else with the head. A lookup round is verified by the same ``target`` call, which
    writes the head's cache layer from the true features and returns the h the next round reads, so
    it leaves the head's state as a head round does (and has no draft KV to crop)."""
    metrics.num_speculations = max_draft_tokens  # CTAR(w) for w = 1..d
    own = EagleDrafter(confidence_threshold)
    return run_drafter(runner, prompt, request, metrics, max_draft_tokens, own, first)
