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

    logits, g = head_step(runner, x, h_prev, start)     # [1, S, V], [1, S, D]
    logits, h = target_step(runner, ids, h_prev, start)  # [1, S, V], [1, S, D]
"""

from __future__ import annotations

import torch

from .metrics import DecodeMetrics
from .rounds import run_drafter
from .runner import StageRunner
from .schedules import (
    DecodeRequest,
    Draft,
    Drafter,
    FirstDrafter,
    draft_steps,
    no_draft,
)


def head_step(
    runner: StageRunner, input_ids: torch.Tensor, hidden: torch.Tensor, start: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The draft head on tokens ``input_ids`` [1, S] at positions start.. reading ``hidden``
    [1, S, D] (h_{t-1} of each token, or the head's own g); returns (logits [1, S, V],
    g [1, S, D]) and writes the head's cache layer for those positions."""
    # Timed as "draft" / "verify" (``runner.seconds``), the names the bench's cost ratios read.
    out = runner.chunk("head", input_ids, start, key="draft", hidden=hidden)
    return out["logits"], out["hidden"]


def target_step(
    runner: StageRunner, input_ids: torch.Tensor, prev_hidden: torch.Tensor | None, start: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The full model (and the head's KV from true features) on ``input_ids`` [1, S] at
    positions start..; ``prev_hidden`` [1, 1, D] is h_{start-1} (at 0: zeros, [1, 1, 1] or None).
    Returns
    (logits [1, S, V], h [1, S, D], pre-norm); at ``start`` 0 (a prompt) the logits are the last
    position's only, [1, 1, V] (``StageRunner.chunk``)."""
    out = runner.chunk("target", input_ids, start, key="verify", prev_hidden=prev_hidden)
    return out["logits"], out["hidden"]


def draft_chain(
    runner: StageRunner,
    x: torch.Tensor,
    h_prev: torch.Tensor,
    start: int,
    max_tokens: int,
    threshold: float,
    request: DecodeRequest,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Draft up to ``max_tokens`` from token x [1, 1] at ``start`` and h_{start-1} [1, 1, D].

    Returns draft tokens [1, d] and, when sampling, their draft distributions q [1, d, V]
    (what rejection sampling compares with the target). With ``threshold`` > 0 drafting stops
    after the first token whose top-1 probability is <= threshold (that token is kept).
    """
    hidden = h_prev

    def step(token: torch.Tensor, i: int) -> torch.Tensor:
        nonlocal hidden
        logits, hidden = head_step(runner, token, hidden, start + i)  # [1, 1, V], [1, 1, D]
        return logits[:, -1]

    tokens, q, _ = draft_steps(step, x, max_tokens, request, threshold=threshold)
    return tokens, q


class EagleDrafter(Drafter):
    """The draft head proposes (``draft_chain``); ``target`` is the full model with the head's
    KV from true features, and keeps the hidden states h of its last call: after a round that
    kept k drafts, h of position start + k is what the next round's first draft reads."""

    name = "eagle"

    def __init__(self, layout, threshold: float) -> None:
        self.threshold = threshold
        # h_{-1} for the prompt's first token: zeros, broadcast to D
        self.h = torch.zeros(1, 1, 1, dtype=layout.dtype, device=layout.device)
        self._hidden: torch.Tensor | None = None  # [1, S, D]: of the last target call

    def prefill(self, runner, prompt):
        logits = self.target(runner, prompt, 0)  # [1, n, V]
        self.h = self._hidden[:, -1:]  # h_{n-1}: [1, 1, D]
        return logits

    def target(self, runner, ids, start, key=None):
        logits, self._hidden = target_step(runner, ids, self.h, start)
        return logits

    def propose(self, runner, x, start, d, request, out) -> Draft:
        if d == 0:
            return no_draft(x)
        drafts, q = draft_chain(runner, x, self.h, start, d, self.threshold, request)
        # The draft's head KV came from the head's own states; verify rewrites it from h.
        # Only the head's cache layer holds positions >= start, so this crops it alone.
        runner.cache.crop(start)
        return Draft(drafts, q, self.name)

    def accepted(self, runner, start, k):
        self.h = self._hidden[:, k : k + 1]  # h of the last kept position


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
    own = EagleDrafter(runner.layout, confidence_threshold)
    return run_drafter(runner, prompt, request, metrics, max_draft_tokens, own, first)
