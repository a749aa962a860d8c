"""SpecEE decoding (sec. 4-5): per-token early exit decided by predictors, lossy or verified.

One decode step for token x at position c (the stages of ``leapfx.passes.specee_stages``)::

    draft      layers < E and the draft head: h_{E-1} and S, the top-k speculative tokens
    for l = E-1 .. L-2 (layer l runs first when l >= E):
        if l is active:  prob = MLP_l(features(h_l, S))          one host sync
            if prob > threshold:  g = argmax N(h_l) W^T          one more host sync
                if g in S: exit at l, emit g (sec. 4.3.3); else go on
    no exit: layer L-1, the head, emit its token

Two-level scheduling (sec. 5): a layer is active if the offline level kept it (measured exit
frequencies, saved with the predictors) or it lies within +-``window`` of one of the last
``history`` exits (the online level, once ``history`` exits have been seen). Features need
p_{l-1}, so z is also computed at the layer below each active one (spec sec. 9.1).

KV of exited layers (``kv_fill``):

- ``"mask"`` (the authors' implementations; the default with ``verify=True``): the layers
  above the exit write no K/V for the token; their cache length still moves past it
  (positions stay global for RoPE) and a per-layer validity bias (0 / -inf,
  ``[L, max_len]``) hides the slot from later queries.
- ``"next"`` (the lossy default: the better agreement per speed, docs/recipes.md): the exited
  token's hidden state stays pending and its skipped layers run batched
  with the next token's pass (rows join at the layer where they stopped), so every slot a query
  reads is filled exactly. Invariant: at each layer the missing positions are a suffix, so a
  batch writes at that layer's fill length.

Verified mode (``verify=True``, lossless): each exited token is a draft. A round drafts until
``max_draft_tokens`` drafts or a pass that reaches the last layer, then verifies as LayerSkip's
remainder does: with m the lowest exit of the round, the last draft runs layers <= m, layers
m+1..L-1 are rolled back to c and rerun on h_m of positions c..c+d (every slot they read is
then exact), and ``schedules.accept`` takes the prefix (greedy match or rejection sampling).
A round whose first pass does not exit emits that token directly: its context was exact.

Host syncs: one per active layer (the predictor's decision), one more where it fires (the
global check), and in verified mode one per round (as ``self_speculative``).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

import torch
from torch import fx

from ..modules.specee import LayerExit
from .executor import builds_masks
from .masks import chunk_mask, masks_for
from .metrics import DecodeMetrics
from .rounds import speculative_loop
from .runner import StageRunner
from .schedules import (
    DecodeRequest,
    Draft,
    Drafter,
    Pass,
    _drafted,
    choose,
    draft_probs,
    exit_loop,
)


@dataclass
class LayerScheduler:
    """The two-level schedule of sec. 5: offline subset + online +-window of recent exits.

    >>> s = LayerScheduler(offline=frozenset({10}), low=3, high=14, history=2)
    >>> sorted(s.active())
    [10]
    >>> s.record(5); s.record(13); sorted(s.active())
    [3, 4, 5, 6, 7, 10, 11, 12, 13, 14]
    """

    offline: frozenset[int]
    low: int  # first predicted layer (E - 1)
    high: int  # last predicted layer (L - 2)
    window: int = 2
    history: int = 5
    recent: deque = field(default_factory=deque)
    _active: frozenset[int] | None = None
    _needed: frozenset[int] | None = None

    def record(self, layer: int) -> None:
        """A token exited after ``layer``."""
        self.recent.append(layer)
        if len(self.recent) > self.history:
            self.recent.popleft()
        self._active = self._needed = None

    def active(self) -> frozenset[int]:
        """Layers whose predictor runs for the next token."""
        if self._active is None:
            layers = {i for i in self.offline if self.low <= i <= self.high}
            if len(self.recent) >= self.history:
                for e in self.recent:
                    lo, hi = max(self.low, e - self.window), min(self.high, e + self.window)
                    layers.update(range(lo, hi + 1))
            self._active = frozenset(layers)
        return self._active

    def needed(self) -> frozenset[int]:
        """Layers whose features are computed: the active ones and the layer below each."""
        if self._needed is None:
            act = self.active()
            self._needed = act | {i - 1 for i in act if i - 1 >= self.low}
        return self._needed


@dataclass(frozen=True)
class SpecEEConfig:
    """What the SpecEE schedule needs from the recipe's options."""

    threshold: float
    offline: frozenset[int]
    verify: bool = False
    kv_fill: str = "next"
    max_draft_tokens: int = 6
    window: int = 2
    history: int = 5
    # The draft stage's logits are the host's own norm and LM head on h_{E-1} (drafter
    # "exit_head"): the global check at layer E-1 reuses them instead of a head call.
    head_drafts: bool = False


@dataclass
class Step:
    """One token's pass: the emitted (or drafted) token, its exit layer and its hidden states."""

    token: torch.Tensor  # [1, 1]
    exit_layer: int  # layers 0..exit_layer ran
    logits: torch.Tensor  # [1, V] at the exit layer
    hidden: dict[int, torch.Tensor]  # l -> h_l [1, 1, H] for l >= E - 1 that ran


class SpecEEDecoder:
    """The state of one SpecEE decode over a StageRunner (see the module docstring)."""

    def __init__(self, runner: StageRunner, config: SpecEEConfig, metrics: DecodeMetrics):
        self.runner = runner
        self.config = config
        self.metrics = metrics
        layers = sorted(int(n.split("_")[1]) for n in runner.stages if n.startswith("layer_"))
        self.first = layers[0]  # E: layers < E run in the draft stage
        self.num_layers = layers[-1] + 1  # L
        self.scheduler = LayerScheduler(
            config.offline, self.first - 1, self.num_layers - 2, config.window, config.history
        )
        lay = runner.layout
        self.impl, self.kinds, self.window = lay.impl, lay.kinds, lay.window
        cache = runner.cache
        # Additive validity bias per layer and position (kv_fill="mask"): 0 or -inf.
        self.bias = torch.zeros(
            self.num_layers, cache.max_len, dtype=lay.dtype, device=lay.device
        )  # [L, max_len]
        self.neg = float("-inf") if self.impl == "sdpa" else torch.finfo(lay.dtype).min
        # Every layer <= this one holds valid K/V at every cached position (no bias needed).
        self.all_valid_below = self.num_layers - 1
        # kv_fill="next": (h [1, r, H], rope of those rows, start, next layer) per group.
        self.pending: list[tuple[torch.Tensor, tuple, int, int]] = []
        self.predictor_seconds = 0.0
        self._masks: dict = {}  # kv_fill="next": the batch mask of the current rows
        # EAGLE drafter: the head reads h of the previous position (pre-norm; for an exited
        # token the state at its exit layer, as the authors' code feeds the exit's state).
        self.eagle = "eagle_head" in runner.stages
        # Compiled layer segments (leapfx.lower.specee_segments) build their masks from positions
        # and take the validity bias as an input instead of a host-built mask.
        self.compiled = builds_masks(runner.stages[f"layer_{self.first}"])
        # Eager: each exit check's stage is one call_module node (a LayerExit); the decoder
        # calls that module's ``check`` directly, which skips the GraphModule wrapper and its
        # output dict (about a third of a torch check of this size) and, with the CPU kernels
        # (KernelLayerExit), is one op that also returns the global check's logits where it
        # fires. The check runs at every active layer of every token.
        self.checks: dict[int, LayerExit] = {}
        for name, stage in runner.stages.items():
            if name.startswith("check_") and isinstance(stage, fx.GraphModule):
                node = next(n for n in stage.graph.nodes if n.op == "call_module")
                self.checks[int(name.removeprefix("check_"))] = stage.get_submodule(node.target)
        self.h_prev: torch.Tensor | None = None  # [1, 1, H]
        self.k = 4

    def prefill(self, prompt: torch.Tensor) -> torch.Tensor:
        """Every layer on the prompt; returns the logits [1, n, V]."""
        if not self.eagle:
            return self.runner.full(prompt, 0)
        out = self.runner.chunk("target", prompt, 0, prev_hidden=None)
        self.h_prev = out["hidden"][:, -1:]
        return out["logits"]

    def _candidates(self, x: torch.Tensor, pos: int, out: dict) -> torch.Tensor:
        """S [k] for token x at ``pos``: from the draft stage, or the EAGLE head's stage."""
        if not self.eagle:
            return out["candidates"]
        head = self.runner.chunk("eagle_head", x, pos, hidden=self.h_prev)
        return head["logits"][0, -1].topk(self.k).indices  # [k]

    # -- stage calls -------------------------------------------------------------------------

    def _positions(self, start: int, length: int) -> torch.Tensor:
        return torch.arange(start, start + length, device=self.runner.layout.device)[None]

    def _rope(self, hidden: torch.Tensor, start: int, length: int):
        out = self.runner.call("rope", hidden=hidden, position_ids=self._positions(start, length))
        return out["rope"]

    def _layer(self, i: int, hidden, rope, start: int, mask) -> torch.Tensor:
        n = hidden.shape[1]
        extra = {"bias": self.bias[i]} if self.compiled else {}
        out = self.runner.call(
            f"layer_{i}", hidden=hidden, rope=rope, mask=mask,
            position_ids=self._positions(start, n), cache=self.runner.cache, **extra,
        )  # fmt: skip
        return out["hidden"]  # [1, n, H]

    def _head(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.runner.call("head", hidden=hidden)["logits"]  # [1, n, V]

    def _kind(self, i: int) -> str:
        return self.kinds[i]

    def _mask(self, i: int, start: int, length: int, base: dict) -> torch.Tensor | None:
        """Layer i's mask for queries start..start+length-1: the chunk mask plus validity."""
        if i <= self.all_valid_below or self.config.kv_fill == "next":
            return base[self._kind(i)]
        end = start + length
        w = self.window if self._kind(i) == "sliding_attention" else None
        causal = chunk_mask(
            self.impl, start, length, window=w, dtype=self.bias.dtype,
            device=self.bias.device, additive=True,
        )  # fmt: skip
        bias = self.bias[i, :end].view(1, 1, 1, end)
        return bias if causal is None else causal + bias

    def _base_masks(self, start: int, length: int) -> dict:
        lay = self.runner.layout
        return masks_for(
            lay.impl, list(lay.kinds), start, length,
            window=lay.window, dtype=lay.dtype, device=lay.device, additive=True,
        )  # fmt: skip

    # -- one token ---------------------------------------------------------------------------

    def step(
        self, x: torch.Tensor, pos: int, request: DecodeRequest, drafts: torch.Tensor | None = None
    ) -> Step:
        """Run token x [1, 1] at ``pos`` until its predicted exit (or the last layer);
        ``drafts`` [1, i]: the round's drafts before this step's token (verified mode), which
        processors read as part of the prefix."""
        runner, cfg = self.runner, self.config
        call, cache = runner.call, runner.cache
        out = runner.chunk("draft", x, pos)
        cands = self._candidates(x, pos, out)  # [k]
        h, rope = out["hidden"], out["rope"]  # [1, 1, H]
        base = self._base_masks(pos, 1)
        active, needed = self.scheduler.active(), self.scheduler.needed()
        # Only verify reads the per-layer states back (``Step.hidden``): lossy decoding keeps none.
        keep = cfg.verify
        hidden = {self.first - 1: h}
        fill_next = cfg.kv_fill == "next"
        p_prev, prev_layer = None, -1
        batch_start = pos  # kv_fill="next": the first position of the rows in flight
        positions = self._positions(pos, 1)  # of the rows in flight: rebuilt where rows join
        last = self.num_layers - 1
        for i in range(self.first - 1, self.num_layers):
            if i >= self.first:
                if fill_next:
                    if self.pending and self.pending[-1][3] == i:
                        h, rope, batch_start = self._join(i, h, rope, pos)
                        positions = self._positions(batch_start, pos + 1 - batch_start)
                    if batch_start == pos:
                        mask = base[self.kinds[i]]
                    else:
                        mask = self._batch_mask(i, batch_start, pos)
                else:
                    mask = self._mask(i, pos, 1, base)
                extra = {"bias": self.bias[i]} if self.compiled else {}
                h = call(
                    f"layer_{i}", hidden=h, rope=rope, mask=mask, position_ids=positions,
                    cache=cache, **extra,
                )["hidden"]  # fmt: skip
                if keep:
                    hidden[i] = h[:, -1:]
            if i == last or i not in needed:
                continue
            t0 = time.perf_counter()
            fired = False
            check = self.checks.get(i)
            # Exit-head drafter at E-1: the draft stage computed N(h_{E-1}) W^T already.
            reuse = cfg.head_drafts and i == self.first - 1
            logits = None
            if i in active:
                prev = p_prev if prev_layer == i - 1 else None
                if check is not None:  # 2.0: the op leaves the logits to the reuse below
                    prob, p, logits = check.check(h, cands, prev, 2.0 if reuse else cfg.threshold)
                else:
                    res = call(f"check_{i}", hidden=h, candidates=cands, p_prev=prev)
                    prob, p = float(res["prob"]), res["p"]  # host sync: the exit decision
                fired = prob > cfg.threshold
            elif check is not None:
                p = check.forward(h, cands, None, with_mlp=False)[1]
            else:
                p = call(f"probs_{i}", hidden=h, candidates=cands)["p"]
            p_prev, prev_layer = p, i
            exited = False
            if fired:
                if reuse:
                    logits = out["logits"][:, -1]
                elif logits is None:
                    logits = self._head(h[:, -1:])[:, -1]  # [1, V]: the global check
                exited = bool((cands == logits.argmax(dim=-1)).any())  # host sync
            self.predictor_seconds += time.perf_counter() - t0
            if exited:
                self._exit(i, pos, h, rope, batch_start)
                self.h_prev = h[:, -1:]
                return Step(choose(logits, request, drafts), i, logits, hidden)
        logits = self._head(h[:, -1:])[:, -1]
        self.pending = []
        self.h_prev = h[:, -1:]
        return Step(choose(logits, request, drafts), self.num_layers - 1, logits, hidden)

    def _exit(self, i: int, pos: int, h: torch.Tensor, rope, batch_start: int) -> None:
        """Bookkeeping of a token that exits after layer i (``rope``: of the rows of ``h``)."""
        self.scheduler.record(i)
        cache = self.runner.cache
        if self.config.kv_fill == "next":
            # Groups still pending stopped at or above this exit (those below it joined);
            # one that also waits for layer i + 1 merges: its positions come just before.
            if self.pending and self.pending[-1][3] == i + 1:
                rows, rows_rope, start, _ = self.pending.pop()
                h, rope = torch.cat([rows, h], dim=1), _cat_rope(rows_rope, rope)
                batch_start = start
            self.pending.append((h, rope, batch_start, i + 1))
            return
        self.bias[i + 1 :, pos] = self.neg
        for j in range(i + 1, self.num_layers):
            cache.lengths[j] = pos + 1  # the slot stays empty; the bias hides it
        self.all_valid_below = min(self.all_valid_below, i)

    def _join(self, i: int, h, rope, pos: int):
        """kv_fill="next": prepend the pending rows that stopped below layer i.

        Their rotary pair was computed with their own pass: the join concatenates it instead of
        calling the rope stage (each position's pair does not depend on the others).
        """
        rows, rows_rope, start, _ = self.pending.pop()
        assert self.runner.cache.lengths[i] == start, "missing K/V must be a suffix"
        assert rows.shape[1] + h.shape[1] == pos + 1 - start, "rows are positions start..pos"
        return torch.cat([rows, h], dim=1), _cat_rope(rows_rope, rope), start

    def _batch_mask(self, i: int, start: int, pos: int):
        kind = self._kind(i)
        key = (kind, start, pos)  # rows keep their start over several layers: build it once
        if key not in self._masks:
            w = self.window if kind == "sliding_attention" else None
            self._masks = {key: chunk_mask(
                self.impl, start, pos + 1 - start, window=w, dtype=self.bias.dtype,
                device=self.bias.device, additive=True,
            )}  # fmt: skip
        return self._masks[key]

    # -- verified mode -----------------------------------------------------------------------

    def verify(self, steps: list[Step], last: torch.Tensor, c: int) -> torch.Tensor:
        """Target logits [1, d+1, V] for drafts at positions c+1..c+d and the bonus.

        ``steps`` are the passes of positions c..c+d-1; ``last`` [1, 1] is the newest draft at
        c + d, not yet run.
        """
        d = len(steps)
        m = min(s.exit_layer for s in steps)
        if self.eagle:  # the head's cache layer holds every position: fill the last draft's
            self._candidates(last, c + d, {})
        out = self.runner.chunk("draft", last, c + d)
        h = out["hidden"]
        base = self._base_masks(c + d, 1)
        for i in range(self.first, m + 1):
            h = self._layer(i, h, out["rope"], c + d, base[self._kind(i)])
        rows = torch.cat([s.hidden[m] for s in steps] + [h[:, -1:]], dim=1)  # [1, d+1, H]
        if m == self.num_layers - 1:  # cannot happen: a round's first full pass never drafts
            raise AssertionError("verify needs a draft that exited")
        cache = self.runner.cache
        rope = self._rope(rows, c, d + 1)
        base = self._base_masks(c, d + 1)
        self.bias[m + 1 :, c : c + d + 1] = 0
        for i in range(m + 1, self.num_layers):
            cache.lengths[i] = c  # roll the layer back to the round's start
            rows = self._layer(i, rows, rope, c, base[self._kind(i)])
        self.verified = rows  # [1, d+1, H]: h of the last layer, exact
        return self._head(rows)  # [1, d+1, V]


def _cat_rope(first, second):
    """The rotary pair (cos, sin) [1, a + b, D] of two runs of rows, in order."""
    return tuple(torch.cat([x, y], dim=1) for x, y in zip(first, second, strict=True))


def specee(
    runner: StageRunner,
    prompt: torch.Tensor,
    request: DecodeRequest,
    metrics: DecodeMetrics,
    config: SpecEEConfig,
) -> list[int]:
    """SpecEE decoding: lossy early exit, or verified (lossless) with ``config.verify``."""
    dec = SpecEEDecoder(runner, config, metrics)
    if config.verify:
        drafter = SpecEEDrafter(dec, metrics)
        tokens = speculative_loop(
            runner, prompt, request, metrics, config.max_draft_tokens, drafter
        )
        runner.seconds["predictor"] += dec.predictor_seconds
        return tokens

    def step(x: torch.Tensor, pos: int) -> Pass:
        if pos == 0:  # the prompt: every layer, no exit
            return Pass(dec.prefill(x), "full_calls", dec.num_layers)
        s = dec.step(x, pos, request)  # the pass chose its token at its exit
        return Pass(s.logits[:, None], "draft_calls", s.exit_layer + 1, token=s.token)

    tokens = exit_loop(step, prompt, request, metrics)
    runner.seconds["predictor"] += dec.predictor_seconds
    return tokens


class SpecEEDrafter(Drafter):
    """Verified SpecEE: each exited token is a draft. A round drafts from x at ``start`` until
    ``d`` drafts (at least one) or a pass that reaches the last layer; a round whose first pass
    does not exit emits that token without a verify (its context was exact). The verify is
    ``SpecEEDecoder.verify`` over the round's passes; its rounds are not counted per drafter."""

    def __init__(self, dec: SpecEEDecoder, metrics: DecodeMetrics) -> None:
        self.dec, self.metrics = dec, metrics
        self.steps: list[Step] = []

    def prefill(self, runner, prompt):
        logits = self.dec.prefill(prompt)  # every layer, no exit
        self.metrics.record_layers(self.dec.num_layers)
        return logits

    def propose(self, runner, x, start, d, request, out) -> Draft:
        dec, last = self.dec, self.dec.num_layers - 1
        dec.all_valid_below = last  # everything before start is verified
        steps: list[Step] = []
        qs = []
        token = x
        while True:
            before = _drafted([s.token for s in steps])  # [1, i]: this round's drafts so far
            s = dec.step(token, start + len(steps), request, before)
            if not steps and s.exit_layer == last:
                # The first pass ran every layer over an exact context: its token is final.
                self.metrics.record_layers(dec.num_layers)
                return Draft(x[:, :0], calls=1, final=(s.token, s.logits))
            steps.append(s)
            if request.sampling.do_sample:
                qs.append(draft_probs(s.logits, request, before))
            token = s.token
            if len(steps) >= d or s.exit_layer == last:
                break
        self.steps = steps
        drafts = torch.cat([s.token for s in steps], dim=1)  # [1, d]
        return Draft(drafts, torch.stack(qs, dim=1) if qs else None, state=steps)

    def verify(self, runner, x, start, draft, request):
        return self.dec.verify(draft.state, draft.tokens[:, -1:], start)  # [1, d+1, V]

    def accepted(self, runner, start, k):
        dec = self.dec
        dec.h_prev = dec.verified[:, k : k + 1]  # h of position start + k: the next token reads it
        # Layers per emitted token: the draft's own depth (the verify pass is counted in
        # stage_seconds, not here); the correction/bonus token ran every layer.
        for s in self.steps[:k]:
            self.metrics.record_layers(s.exit_layer + 1)
        self.metrics.record_layers(dec.num_layers)
