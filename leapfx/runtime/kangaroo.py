"""Kangaroo's decode schedule: dynamic drafting with the adapter (sec. 3.2), one verify a round.

Stages (``leapfx.passes.partition`` on a graph with a Kangaroo adapter):

- ``full``: every layer, plus the adapter's attention for its KV (prefill);
- ``draft``: layers < l, the adapter, the shared LM head -> the adapter's logits and the early
  feature (layer l-1's output) of each token;
- ``verify``: layers < l and the adapter's attention on the last draft token, then layers >= l,
  norm and head on the early features of the round (the "double early exit": the shallow
  sub-network's states are reused, never recomputed).

A round, with the newest token x at position p (not yet in the cache) and every cache layer --
the host layers' and the adapter's -- holding positions 0..p-1::

    draft:  y_1..y_d from x, y_1, ..; stops after the first y_i whose draft confidence
            max_n M^s_n <= eta (eq. 4) or at d = gamma. Writes lower + adapter KV for p..p+d-1.
    verify: y_d through layers < l and the adapter's attention (KV for p+d), then the upper
            layers on p..p+d -> d+1 target distributions.
    accept: k drafts and a correction/bonus token; crop every cache layer to p+k+1 (O(1)).

So the adapter has KV for every committed position before it drafts again. This is the case of
the paper's Figure 2: when all d drafts are accepted, the adapter has not yet seen y_d (it only
proposed it), and the paper feeds [f_d, f_{d+1}] through the adapter at the start of the next
round. Here verify already computes y_d's early feature f_d (it runs layers < l on y_d), so it
also runs the adapter's attention on f_d, and the next round drafts from the bonus token with a
one-token adapter call: no separate adapter pass, no two-token catch-up. When a draft is
rejected, the crop drops that KV with the rest.

Confidence: greedy decoding reads the adapter's softmax; sampling reads the warped distribution q
it samples from (the one rejection sampling compares with the target). eta = 0 never stops
early: fixed-length drafting, with no host sync inside the draft loop.
"""

from __future__ import annotations

import torch

from .metrics import DecodeMetrics
from .rounds import self_speculative
from .runner import StageRunner
from .schedules import DecodeRequest, FirstDrafter, draft


def draft_until_unsure(
    runner: StageRunner,
    x: torch.Tensor,
    start: int,
    max_tokens: int,
    threshold: float,
    request: DecodeRequest,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Draft from token x [1, 1] at position ``start`` until eq. 4 stops it or ``max_tokens``.

    Returns draft tokens [1, d], their early features [1, d, H] (positions start..start+d-1)
    and, when sampling, the draft distributions q [1, d, V]; 1 <= d <= max_tokens. The token
    whose confidence falls to ``threshold`` or below is kept as the round's last draft.
    """
    return draft(runner, x, start, max_tokens, request, threshold=threshold)


def kangaroo(
    runner: StageRunner,
    prompt: torch.Tensor,
    request: DecodeRequest,
    metrics: DecodeMetrics,
    max_draft_tokens: int,
    confidence_threshold: float,
    first: FirstDrafter | None = None,
) -> list[int]:
    """Kangaroo decoding: adapter drafts with dynamic length, the upper layers verify.

    ``first``: a drafter tried before the adapter each round (``lookup=True``). Its rounds are
    verified by the ``full`` stage, which also runs the adapter's attention on the positions
    it covers, so the adapter's cache layer holds every committed position after them as after its
    own rounds."""
    metrics.num_speculations = max_draft_tokens  # CTAR(w) for w = 1..gamma

    def drafter(runner, x, start, gamma, request):
        return draft_until_unsure(runner, x, start, gamma, confidence_threshold, request)

    return self_speculative(
        runner, prompt, request, metrics, max_draft_tokens, drafter, "kangaroo", first
    )
