"""M2R2's self-speculative schedule (sec. 2.3.2): drafts from the fast stream, slow verify.

Stages (``leapfx.passes.fast_partition``): ``full`` (every slow layer) and ``draft`` (the fast
stream alone: embedding -> k accelerated layers -> final norm -> LM head, one token).

A round, with the newest token x at position p (not yet in the cache; the cache holds the slow
keys of positions 0..p-1)::

    draft:  y_1..y_g from x, y_1, ..: the fast stream only. Draft i (at position p+i) attends
            to the slow keys of 0..p-1 and the fast keys of p..p+i-1 that this round's earlier
            drafts left in a FastScratch; nothing is written into the shared cache, and no slow
            layer runs (unlike LayerSkip/Kangaroo, whose drafts run shallow slow layers).
    verify: one slow pass over [x, y_1..y_g] at p..p+g -> g + 1 target distributions; it writes
            the slow keys of those positions.
    accept: k drafts and a correction/bonus token (greedy prefix match or rejection sampling,
            the acceptance ops every lossless recipe uses); crop the cache to p+k+1 (O(1)).
            The round's scratch is dropped: the fast keys of drafts are never reused.

Lossless for any accelerator, trained or not: the emitted tokens come from the slow pass.
Host syncs: one per round (k and the tokens), plus one per draft with a confidence stop.
"""

from __future__ import annotations

import torch

from ..modules.m2r2_scratch import FastScratch
from .metrics import DecodeMetrics
from .rounds import run_drafter
from .runner import StageRunner
from .schedules import (
    DecodeRequest,
    Draft,
    Drafter,
    FirstDrafter,
    Pass,
    draft_steps,
    exit_loop,
    no_draft,
)


def draft_fast(
    runner: StageRunner,
    x: torch.Tensor,
    start: int,
    max_tokens: int,
    request: DecodeRequest,
    *,
    threshold: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Draft up to ``max_tokens`` from token x [1, 1] at position ``start`` with the fast stream.

    Returns drafts [1, d] and, when sampling, their distributions q [1, d, V]. ``threshold`` > 0
    stops after the first draft whose top-1 probability is <= threshold (kept), one host sync
    per draft; 0 drafts ``max_tokens`` with no sync.
    """
    scratch = FastScratch()  # this round's fast keys: discarded with the round

    def step(token: torch.Tensor, i: int) -> torch.Tensor:
        return runner.fast_draft(token, start + i, scratch)[:, -1]  # [1, V]

    tokens, q, _ = draft_steps(step, x, max_tokens, request, threshold=threshold)
    return tokens, q


class FastDrafter(Drafter):
    """Drafts with the fast stream (``draft_fast``); the slow stream over [x, drafts] is the
    round's verify (a ``full`` call, counted as a verify)."""

    name = "m2r2"

    def __init__(self, threshold: float = 0.0) -> None:
        self.threshold = threshold

    def propose(self, runner, x, start, d, request, out) -> Draft:
        if d == 0:
            return no_draft(x)
        drafts, q = draft_fast(runner, x, start, d, request, threshold=self.threshold)
        return Draft(drafts, q, self.name)


def m2r2(
    runner: StageRunner,
    prompt: torch.Tensor,
    request: DecodeRequest,
    metrics: DecodeMetrics,
    num_speculations: int,
    confidence_threshold: float = 0.0,
    first: FirstDrafter | None = None,
) -> list[int]:
    """M2R2 self-speculative decoding: fast-stream drafts, one slow verify pass a round.

    ``first``: a drafter tried before the fast stream each round (``lookup=True``; a round's
    fast keys live in its own scratch, so nothing but the cache outlives a round)."""
    metrics.num_speculations = num_speculations
    own = FastDrafter(confidence_threshold)
    return run_drafter(runner, prompt, request, metrics, num_speculations, own, first)


def m2r2_exit(
    runner: StageRunner,
    prompt: torch.Tensor,
    request: DecodeRequest,
    metrics: DecodeMetrics,
    gates: tuple[int, ...],
    threshold: float,
    exit_gates: tuple[int, ...] | None = None,
) -> list[int]:
    """M2R2 dynamic early exit (sec. 2.3.1; lossy): exit at the first gate whose ARLA score is
    >= ``threshold`` with the token of the gate's fast state; else reset and go on. Only the
    gates in ``exit_gates`` (None: all) run; the slow stream passes the others.

    Stages (``fast_partition.exit_stages``): ``slow_j`` (layers E_j..E_{j+1}-1), ``gate_j``
    (the fast stream of the interval ending at E_j, its head and its router), ``tail``.

    A token that exits at E_k leaves the keys of layers >= E_k of its position unwritten (the
    paper leaves the fill open). The fill is lazy: its h^{E_k} stays pending and joins, as
    extra rows, the first later pass that reaches segment k, whichever token that is; rows
    ride along from there and leave where that pass stops (or exit with it as one group). So a
    skipped layer runs only when a query is about to read it, batched with that query: a run
    of exits at low gates costs no fill until a token goes deeper. Invariant: at each layer the
    missing positions are a suffix (a group pending at segment k is older than any pending
    below k), so a batch writes at the layer's fill length and every slot a query reads is
    filled. Host syncs: one per gate (the exit decision); none with threshold > 1, where no
    gate can fire and none runs.
    """
    num_layers = len(runner.layout.kinds)  # every decoder layer of the host
    edges = (0, *gates, num_layers)
    last = len(edges) - 2  # the last segment's index
    # (h^{E_k} [1, r, H] of positions start..start+r-1, start, k); k falls along the list.
    pending: list[tuple[torch.Tensor, int, int]] = []
    can_fire = threshold <= 1.0  # a score is a sigmoid: above 1 no gate fires, so none runs
    deciding = set(gates if exit_gates is None else exit_gates)

    def step(token: torch.Tensor, pos: int) -> Pass:
        if pos == 0:
            return Pass(runner.full(token, 0), "full_calls", num_layers)  # the prompt
        exited, gate_logits, start = None, None, pos
        o = runner.rows("slow_0", pos, 1, input_ids=token)  # no group waits below E_1
        h, reset = o["hidden"], o["reset"]  # [1, rows, H]; the current token's is the last
        for j in range(1, last + 1):  # gate j (the fast stream from h^{E_{j-1}}), segment j
            if can_fire and edges[j] in deciding:
                g = runner.rows(f"gate_{j}", pos, 1, masks=False, hidden=reset)
                if float(g["score"].reshape(-1)[0]) >= threshold:  # host sync: the decision
                    exited, gate_logits = j, g["logits"]
                    break
            h, start = _join(runner, pending, h, start, j, edges[j])
            reset = h[:, -1:]  # h^{E_j}
            h = runner.rows(f"slow_{j}", start, h.shape[1], hidden=h)["hidden"]
        if exited is None:
            logits = runner.rows("tail", pos, 1, masks=False, hidden=h[:, -1:])["logits"]
            return Pass(logits, "full_calls", num_layers)
        h, start = _join(runner, pending, h, start, exited, None)
        pending.append((h, start, exited))
        return Pass(gate_logits, "draft_calls", edges[exited])

    return exit_loop(step, prompt, request, metrics)


def _join(runner, pending, h, start: int, segment: int, layer: int | None):
    """Prepend the pending group waiting at ``segment`` (if any) to rows h from ``start``.

    ``layer`` (the segment's first layer) checks the suffix invariant: the group's first
    position is that layer's fill length."""
    if not pending or pending[-1][2] != segment:
        return h, start
    rows, first, _ = pending.pop()
    if layer is not None and runner.cache.lengths[layer] != first:
        raise AssertionError("m2r2_exit: the missing K/V of a layer must be a suffix")
    return torch.cat([rows, h], dim=1), first
