"""Batched decoding: ``generate`` on ``[B, S]`` prompts with left padding, each row accepting its
own drafts over one static KV cache.

Layout. Row b's prompt is left-padded by ``pad_b`` tokens, so its token at position p sits in
cache column ``pad_b + p``: HF's layout for a left-padded batch. Every layer keeps a fill length
per row (:class:`RowKVCache`): a call writes row b's new keys and values at that row's own
length (one slice write while the rows are aligned, one ``index_put`` when they are not) and
reads the columns up to the longest row's end; the mask (:func:`row_masks`, from each row's
query columns and its padding) hides this row's padding and every column past this row's own
end. Rollback is per row and O(1): ``crop_rows`` moves lengths, nothing is copied. With the CPU
kernels, attention reads each row's own span of columns (``leapfx_cpu::attention_rows`` over
:meth:`RowKVCache.spans`) instead of attending through the mask.

The prompts are prefilled in one call over the padded batch, or, on a CPU where the padding is a
sizeable share of the batch (``ROW_PREFILL_PADDING``), a call a row over its own tokens: there a
call's cost follows its rows, and the padded columns would be computed for nothing.

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

import time
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from . import executor
from .adaptive import PRIOR_SLOPE, Acceptance, DraftPolicy
from .cache import StaticKVCache, cache_for
from .executor import StageExecutor
from .lookup import NgramIndex
from .masks import masks_for
from .metrics import DecodeMetrics
from .rounds import Decode, Proposal, RoundDrafter, Row, requests_of_rows
from .runner import PREFILL, AttentionLayout
from .schedules import DecodeRequest, draft_steps, requests_of

DRAFTERS = ("none", "lookup", "stage", "eagle")
# Backends whose stages take a batch's ragged rows: the eager stages, and the compiled ones
# (``lower.inductor``: a batch's graphs write each row at its own columns). ONNX sessions take
# one row.
BATCH_BACKENDS = ("eager", "inductor")

# RowRunner.prefill: on a CPU, prompts whose padding is at least this share of the batch's
# columns are prefilled a row at a time (a call's cost follows its rows there, so padding is
# pure waste, and a row's call costs little more than its share of the padded one).
ROW_PREFILL_PADDING = 0.1


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


class RowKVCache(StaticKVCache):
    """A static KV cache whose layers keep one fill length per row (ragged rows).

    ``ragged`` tells kernel attention (``modules.fused``) that a key's column is not its
    position: attend through the mask, or through :meth:`spans` (``leapfx_cpu::attention_rows``).
    ``first[b]``: row b's first real column (its left padding before it; the runner sets it).

    >>> cache = RowKVCache(num_layers=1, num_kv_heads=1, head_dim=2, max_len=8, batch_size=2)
    >>> _ = cache.update(torch.ones(2, 1, 3, 2), torch.ones(2, 1, 3, 2), 0)
    >>> cache.crop_rows([2, 3]); cache.rows
    [[2, 3]]
    >>> k, _ = cache.update(torch.zeros(2, 1, 1, 2), torch.zeros(2, 1, 1, 2), 0)
    >>> cache.rows, k.shape[2]   # row 0 wrote column 2, row 1 column 3; read to column 3
    ([[3, 4]], 4)
    """

    def __init__(
        self, num_layers, num_kv_heads, head_dim, max_len, *, batch_size, grow_to=None, **kwargs
    ):
        super().__init__(
            num_layers, num_kv_heads, head_dim, max_len, batch_size=batch_size, **kwargs
        )
        # grow_to: the buffers hold max_len columns now and grow (doubling, at most to
        # grow_to) when a row needs more: rows joining and leaving (a server's batch) then copy
        # the columns in use, not the longest a row could reach. Eager stages only: compiled
        # graphs are specialised to the cache length.
        self.grow_to = grow_to
        self.rows: list[list[int]] = [[0] * batch_size for _ in range(num_layers)]
        self.first: list[int] = [0] * batch_size
        self._spans: tuple[tuple, tuple[torch.Tensor, torch.Tensor]] | None = None
        self._claimed: tuple[tuple, tuple[torch.Tensor, torch.Tensor]] | None = None
        self._indices: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    ragged = True

    def _write_index(self, starts: list[int], n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Row and column indices [B, 1], [B, n] of n columns a row from starts[b]: built once
        for every layer of a call (a split verify's two parts: two entries)."""
        key = (tuple(starts), n)
        index = self._indices.get(key)
        if index is None:
            if len(self._indices) >= 4:
                self._indices.clear()
            device = self.keys[0].device
            cols = torch.tensor(starts, device=device)[:, None] + torch.arange(n, device=device)
            index = self._indices[key] = (torch.arange(len(starts), device=device)[:, None], cols)
        return index

    def spans(self, layer_idx: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """After a call wrote ``n`` columns a row to layer ``layer_idx``: each row's first real
        column [B] and the columns of its n queries [B, n] (int64), what
        ``leapfx_cpu::attention_rows`` reads. Built once for all the layers of a call."""
        key = (tuple(self.rows[layer_idx]), n, tuple(self.first))
        if self._spans is None or self._spans[0] != key:
            device = self.keys[0].device
            ends = torch.tensor(self.rows[layer_idx], device=device)
            last = ends[:, None] - n + torch.arange(n, device=device)  # [B, n]
            self._spans = key, (torch.tensor(self.first, device=device), last)
        return self._spans[1]

    @property
    def batch_size(self) -> int:
        return self.keys[0].shape[0]

    def claim(self, layer_idx: int, n: int) -> list[int]:
        """Each row's fill length (its new columns' first), each moved ``n`` on; the layer's
        length is the longest row's."""
        starts = self.rows[layer_idx]
        ends = [s + n for s in starts]
        end = max(ends)
        self.check_room(end)
        self.rows[layer_idx] = ends
        self.lengths[layer_idx] = end
        return starts

    def reserve(self, counts, *, room: int = 0) -> dict[int, list[int]]:
        """Each row's fill length in each layer of ``counts`` after its new columns (see
        ``LayerLengths.reserve``); the buffers grow first where they may."""
        ends = {layer: [s + n for s in self.rows[layer]] for layer, n in counts.items()}
        self.check_room(max([room, *(max(e) for e in ends.values())]))
        return ends

    def advance(self, ends) -> None:
        for layer, e in ends.items():
            self.rows[layer] = e
        self.lengths = [max(layer) for layer in self.rows]

    def write(self, layer_idx: int, at: list[int], key_states, value_states) -> None:
        # key_states, value_states: [B, H_kv, n, D]; row b written from column at[b]
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        n = key_states.shape[-2]
        if min(at) == max(at):
            keys[:, :, at[0] : at[0] + n] = key_states
            values[:, :, at[0] : at[0] + n] = value_states
        else:
            index = self._write_index(at, n)  # ([B, 1], [B, n]): row, column
            keys.transpose(1, 2).index_put_(index, key_states.transpose(1, 2))  # [B, n, H, D]
            values.transpose(1, 2).index_put_(index, value_states.transpose(1, 2))

    def row_view(self, b: int) -> RowKVCache:
        """Row b alone, as a one-row cache over the same storage (its writes land in row b),
        every layer filled to the row's first real column."""
        view = object.__new__(RowKVCache)
        view.__dict__.update(self.__dict__)
        view.grow_to = None  # its buffers are the batch's: it may not reallocate them
        view.keys = [k[b : b + 1] for k in self.keys]
        view.values = [v[b : b + 1] for v in self.values]
        view.first = [self.first[b]]
        view.rows = [[self.first[b]] for _ in self.rows]
        view.lengths = [self.first[b]] * len(self.rows)
        view._spans, view._claimed, view._indices = None, None, {}
        return view

    def claim_rows(self, layer_idx: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`claim` for a kernel layer that writes the buffers itself: each row's first new
        column [B] and first real column [B] (int64, CPU), built once for every layer of a
        call."""
        starts = self.claim(layer_idx, n)
        key = (tuple(starts), tuple(self.first))
        if self._claimed is None or self._claimed[0] != key:
            self._claimed = key, (torch.tensor(starts), torch.tensor(self.first))
        return self._claimed[1]

    @property
    def appends_rows(self) -> bool:
        """Whether ``update`` is this class's claim, write and read (each row's new columns at
        its own fill length, the filled prefix read back): then a kernel layer may claim the
        columns and write the buffers itself (``modules.block_layer``). A subclass with a
        protocol step of its own does not."""
        cls = type(self)
        steps = ("update", "claim", "write", "read")
        return all(getattr(cls, n) is getattr(RowKVCache, n) for n in steps)

    def crop_rows(self, ends: list[int]) -> None:
        """Forget every column >= ``ends[b]`` of row b in every layer (O(1): lengths only)."""
        self.rows = [[min(n, e) for n, e in zip(layer, ends, strict=True)] for layer in self.rows]
        self.lengths = [max(layer) for layer in self.rows]

    def keep(self, rows: list[int]) -> None:
        """Keep only ``rows`` (indices into the current batch), in that order."""
        index = torch.tensor(rows, dtype=torch.long, device=self.keys[0].device)
        self.keys = [k.index_select(0, index) for k in self.keys]
        self.values = [v.index_select(0, index) for v in self.values]
        self.rows = [[layer[r] for r in rows] for layer in self.rows]
        self.first = [self.first[r] for r in rows]
        self.lengths = [max(layer, default=0) for layer in self.rows]
        self._spans, self._claimed, self._indices = None, None, {}

    def reset(self) -> None:
        super().reset()
        self.rows = [[0] * self.batch_size for _ in self.rows]

    def blank(self, batch_size: int) -> RowKVCache:
        """An empty cache of ``batch_size`` rows shaped as this one (layers, heads, length,
        growth)."""
        k = self.keys[0]
        return RowKVCache(
            len(self.keys), [t.shape[1] for t in self.keys], [t.shape[3] for t in self.keys],
            self.max_len, batch_size=batch_size, dtype=k.dtype, device=k.device,
            static_addresses=False, grow_to=self.grow_to,
        )  # fmt: skip

    def check_room(self, end: int) -> None:
        if end > self.max_len and self.grow_to is not None and end <= self.grow_to:
            self.grow(min(self.grow_to, max(end, 2 * self.max_len)))
        super().check_room(end)

    def grow(self, length: int) -> None:
        """Hold ``length`` columns (copies the buffers; written columns keep their place)."""
        if length <= self.max_len:
            return
        pad = (0, 0, 0, length - self.max_len)  # [B, H, L, D]: the L axis, at its end
        self.keys = [torch.nn.functional.pad(k, pad) for k in self.keys]
        self.values = [torch.nn.functional.pad(v, pad) for v in self.values]
        self.max_len = length
        self._spans, self._claimed, self._indices = None, None, {}

    def join(self, other: RowKVCache) -> None:
        """Append ``other``'s rows (a cache of the same layers and heads) after this one's."""
        self.grow(other.max_len)
        other.grow(self.max_len)
        self.keys = [torch.cat([a, b]) for a, b in zip(self.keys, other.keys, strict=True)]
        self.values = [torch.cat([a, b]) for a, b in zip(self.values, other.values, strict=True)]
        self.rows = [a + b for a, b in zip(self.rows, other.rows, strict=True)]
        self.first = self.first + other.first
        self.lengths = [max(layer) for layer in self.rows]
        self._spans, self._claimed, self._indices = None, None, {}


def row_cache_for(
    model, max_len: int, batch_size: int, *, extra_layers: int = 0, grow_to: int | None = None
) -> RowKVCache:
    """A :class:`RowKVCache` shaped for ``model`` (a supported HF causal LM)."""
    return cache_for(
        model, max_len, extra_layers=extra_layers, static_addresses=False,
        cache_type=RowKVCache, batch_size=batch_size, grow_to=grow_to,
    )  # fmt: skip


def row_masks(
    layout: AttentionLayout, starts: list[int], pads: list[int], n: int
) -> dict[str, torch.Tensor | None]:
    """Masks [B, 1, n, max(starts) + n] for n queries a row at columns starts[b].. of rows
    left-padded by pads[b]: row b's query at column c sees columns pads[b]..c (and, under a
    sliding window, those within the window). Aligned unpadded rows get the masks a single
    sequence gets (HF's own choice, None where SDPA's causal flag serves)."""
    if not any(pads) and min(starts) == max(starts):
        return masks_for(
            layout.impl, list(layout.kinds), starts[0], n, window=layout.window,
            dtype=layout.dtype, device=layout.device, additive=True,
        )  # fmt: skip
    device = layout.device
    end = max(starts) + n
    cols = torch.arange(end, device=device)[None, None, :]  # [1, 1, E]
    q = (torch.tensor(starts, device=device)[:, None] + torch.arange(n, device=device))[:, :, None]
    first = torch.tensor(pads, device=device)[:, None, None]  # [B, 1, 1]
    visible = (cols <= q) & (cols >= first)  # [B, n, E]
    blocked = float("-inf") if layout.impl == "sdpa" else torch.finfo(layout.dtype).min
    zero = torch.zeros((), dtype=layout.dtype, device=device)
    out: dict[str, torch.Tensor | None] = {}
    for kind in dict.fromkeys(layout.kinds):
        seen = visible
        if kind == "sliding_attention" and layout.window is not None:
            seen = visible & (cols > q - layout.window)
        out[kind] = torch.where(seen[:, None], zero, blocked)
    return out


class RowRunner:
    """Calls stage executors on [B, n] rows, each row at its own cache column."""

    def __init__(
        self,
        stages: Mapping[str, StageExecutor],
        cache: RowKVCache,
        layout: AttentionLayout,
        pads: list[int],
    ) -> None:
        self.stages, self.cache, self.layout, self.pads = stages, cache, layout, list(pads)
        cache.first = list(pads)
        self.seconds: defaultdict[str, float] = defaultdict(float)

    def call(self, name: str, ids: torch.Tensor, starts: list[int], key: str) -> torch.Tensor:
        """Stage ``name`` on ``ids`` [B, n], row b at columns starts[b]..: logits [B, n, V]
        ([B, 1, V], the last column's, for the prefill where ``executor.prefill_stage``
        allows)."""
        return self.call_outputs(name, ids, starts, key)["logits"]

    def call_outputs(
        self, name: str, ids: torch.Tensor, starts: list[int], key: str, **extra: torch.Tensor
    ) -> dict[str, torch.Tensor]:
        """:meth:`call`'s stage outputs, all of them (a draft stage's ``hidden`` too);
        ``extra``: the stage's other inputs (EAGLE's ``hidden``, ``prev_hidden``)."""
        n = ids.shape[1]
        positions = self._positions(starts, n)
        stage = self.stages[name]
        if key == PREFILL:  # the prompts: the head on their last position only
            stage = executor.prefill_stage(stage)
        begin = time.perf_counter()
        out = stage(
            input_ids=ids,
            position_ids=positions,
            masks=self._masks(stage, starts, n),
            cache=self.cache,
            **extra,
        )
        self.seconds[key] += time.perf_counter() - begin
        return out

    def _masks(
        self, stage, starts: list[int], n: int, pads: list[int] | None = None
    ) -> dict[str, torch.Tensor | None]:
        """:func:`row_masks` for ``stage``, or none where the stage builds its own (a compiled
        stage, from the cache's row lengths) or every mask reader of the stage is a kernel
        layer (``executor.mask_free``), which attends a batch's rows through
        ``leapfx_cpu::attention_rows``, reading each row's span instead."""
        if executor.builds_masks(stage) or executor.mask_free(stage) is not None:
            return dict.fromkeys(self.layout.kinds)
        return row_masks(self.layout, starts, self.pads if pads is None else pads, n)

    def _positions(self, starts: list[int], n: int) -> torch.Tensor:
        device = self.layout.device
        cols = torch.tensor(starts, device=device)[:, None] + torch.arange(n, device=device)
        return (cols - torch.tensor(self.pads, device=device)[:, None]).clamp(min=0)

    def verify(
        self, ids: torch.Tensor, exit_hidden: torch.Tensor, starts: list[int]
    ) -> torch.Tensor:
        """The ``verify`` stage (``passes.partition``) for every row: ``exit_hidden`` [B, c, H],
        the exit states the draft stage computed at columns starts[b]..; ``ids`` [B, m], the
        tokens after them, which run through the lower layers here. Returns the full model's
        logits at all c + m columns, [B, c + m, V]; the cache's lower layers must hold the c
        columns the draft wrote, the upper ones end at starts[b]."""
        c, m = exit_hidden.shape[1], ids.shape[1]
        new = [s + c for s in starts]
        stage = self.stages["verify"]
        begin = time.perf_counter()
        out = stage(
            input_ids=ids,
            position_ids=self._positions(new, m),
            masks=self._masks(stage, new, m),
            exit_hidden=exit_hidden,
            remainder_position_ids=self._positions(starts, c + m),
            remainder_masks=self._masks(stage, starts, c + m),
            cache=self.cache,
        )
        self.seconds["verify"] += time.perf_counter() - begin
        return out["logits"]

    def prefill(self, name: str, prompt: torch.Tensor) -> torch.Tensor:
        """Stage ``name`` over the left-padded prompts ``prompt`` [B, S] from column 0: logits
        [B, 1 or S, V] (see :meth:`prefill_outputs`)."""
        return self.prefill_outputs(name, prompt)["logits"]

    def prefill_outputs(
        self, name: str, prompt: torch.Tensor, *, alone: bool = False, **extra: torch.Tensor
    ) -> dict[str, torch.Tensor]:
        """Stage ``name``'s outputs over the left-padded prompts ``prompt`` [B, S] from column
        0, each output's last position at least ([B, 1, ...]; ``logits`` [B, 1 or S, V]).

        On a CPU, where a call's cost follows its rows, a batch whose padding is at least
        ``ROW_PREFILL_PADDING`` of its columns (any padding with ``alone``: a stage whose
        state runs across positions, EAGLE's shifted hidden states, would read the padding's)
        runs a call a row over that row's own tokens (no compute on padding; every output
        [B, 1, ...]); otherwise, and for a compiled stage (whose graphs take the whole cache,
        not a row's view of it), one call over the padded batch. ``extra``: the stage's other
        inputs, [B, ...] (a call a row takes row b's)."""
        B, S = prompt.shape
        padding = sum(self.pads) / (B * S)
        compiled = executor.builds_masks(self.stages[name])
        by_row = padding > 0 if alone else padding >= ROW_PREFILL_PADDING
        if B == 1 or prompt.device.type != "cpu" or not by_row or compiled:
            return self.call_outputs(name, prompt, [0] * B, PREFILL, **extra)
        cache, outs = self.cache, []
        stage = executor.prefill_stage(self.stages[name])
        written = [list(layer) for layer in cache.rows]
        for b, pad in enumerate(self.pads):
            view = cache.row_view(b)
            n = S - pad
            begin = time.perf_counter()
            out = stage(
                input_ids=prompt[b : b + 1, pad:],
                position_ids=torch.arange(n, device=prompt.device)[None],
                masks=self._masks(stage, [pad], n, [pad]),  # the view: row b alone
                cache=view,
                **{k: v[b : b + 1] for k, v in extra.items()},
            )
            self.seconds[PREFILL] += time.perf_counter() - begin
            outs.append({k: v[:, -1:] for k, v in out.items()})
            for layer, rows in enumerate(view.rows):
                if rows[0] != pad:  # the stage wrote this layer
                    written[layer][b] = rows[0]
        cache.rows = written
        cache.lengths = [max(layer) for layer in written]
        return {k: torch.cat([o[k] for o in outs]) for k in outs[0]}

    def keep(self, rows: list[int]) -> None:
        self.cache.keep(rows)
        self.pads = [self.pads[r] for r in rows]

    def alone(self) -> RowRunner:
        """A runner of one row over an empty cache shaped as this one's (a row that joins)."""
        return RowRunner(self.stages, self.cache.blank(1), self.layout, [0])

    def join(self, other: RowRunner) -> None:
        """Append ``other``'s rows (its cache's and pads) after this runner's."""
        self.cache.join(other.cache)
        self.pads = self.pads + other.pads


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
    :class:`BatchDrafter` of the recipe's ``plan`` over a :class:`RowRunner`. ``policy``
    chooses each round's draft length (None: always ``plan.num_speculations``).
    ``batched_loop`` is ``start`` then rounds until no row is left; a server admits its
    requests between rounds (continuous batching)."""

    def __init__(
        self,
        runner: RowRunner,
        metrics: DecodeMetrics,
        plan: BatchPlan,
        policy: BatchPolicy | None,
    ) -> None:
        super().__init__(runner, metrics, BatchDrafter(plan, policy))
        self.plan, self.policy = plan, policy
        if policy is not None:
            policy.restart()


def batched_loop(
    runner: RowRunner,
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
    their exit states. ``policy`` chooses each round's d from the live acceptance and the
    measured cost of a round at this batch size (None: ``plan.num_speculations``)."""

    def __init__(
        self, plan: BatchPlan, policy: BatchPolicy | None, eagle: _EagleRows | None = None
    ) -> None:
        self.plan, self.policy = plan, policy
        if eagle is None and plan.drafter == "eagle":
            eagle = _EagleRows(plan.threshold)
        self.eagle = eagle
        self._d = 0  # the round's draft length (a split verify needs every row at it)

    def new_row(self, row: Row, prompt: list[int]) -> None:
        if self.plan.drafter == "lookup" or self.plan.lookup:
            row.ngrams = NgramIndex(self.plan.max_ngram, self.plan.min_ngram)
            row.ngrams.extend(prompt)

    def prefill(self, runner: RowRunner, prompt: torch.Tensor) -> torch.Tensor:
        if self.eagle is not None:
            return self.eagle.prefill(runner, prompt)
        return runner.prefill("full", prompt)  # [B, 1 or S, V]

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
                logits = self.eagle.verify(runner, ids, starts, key)
            else:
                logits = runner.call("full", ids, starts, key)
        if width:
            metrics.verify_calls += 1
        else:
            metrics.full_calls += 1
        return logits

    def accepted(self, runner, rows, proposal, kept, metrics, seconds) -> None:
        if self.eagle is not None:
            self.eagle.accepted(kept)
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
        return BatchDrafter(self.plan, None, _EagleRows(0.0) if self.eagle is not None else None)


def _lookup_drafts(row: Row, d: int) -> list[int]:
    if row.ngrams is None or d <= 0:
        return []
    tokens, _ = row.ngrams.match(d)
    return list(tokens)


class _EagleRows:
    """EAGLE in a batch (``runtime.eagle``'s schedule, a row at a time): ``h`` [B, 1, D] is
    each row's pre-norm last-layer state of its newest kept token, what the row's next first
    draft reads; ``hidden`` [B, n, D], the states of the latest ``target`` call."""

    def __init__(self, threshold: float) -> None:
        self.threshold = threshold
        self.h: torch.Tensor | None = None
        self.hidden: torch.Tensor | None = None

    def prefill(self, runner: RowRunner, prompt: torch.Tensor) -> torch.Tensor:
        """``target`` over the prompts (each row's own tokens wherever a row is padded, so
        that its first token's h_{-1} is zeros, as a row alone gets): logits [B, 1 or S, V]."""
        zeros = torch.zeros(prompt.shape[0], 1, 1, dtype=runner.layout.dtype,
                            device=prompt.device)  # fmt: skip
        out = runner.prefill_outputs("target", prompt, alone=True, prev_hidden=zeros)
        self.h = out["hidden"][:, -1:]
        return out["logits"]

    def verify(self, runner: RowRunner, ids: torch.Tensor, starts: list[int], key: str):
        """``target`` on [x, drafts] [B, n] at each row's columns (host and head KV from the
        true features): logits [B, n, V]."""
        out = runner.call_outputs("target", ids, starts, key, prev_hidden=self.h)
        self.hidden = out["hidden"]
        return out["logits"]

    def accepted(self, kept: list[int]) -> None:
        """Row b kept ``kept[b]`` drafts: its h is the target's state at that position."""
        device = self.hidden.device
        rows = torch.arange(len(kept), device=device)
        self.h = self.hidden[rows, torch.tensor(kept, device=device)][:, None]

    def keep(self, live: list[int]) -> None:
        self.h = self.h[live]

    def join(self, other: _EagleRows) -> None:
        """Append ``other``'s rows' states after this batch's."""
        self.h = other.h if self.h is None or not len(self.h) else torch.cat([self.h, other.h])

    def drafts(
        self, runner: RowRunner, rows: list[Row], x: torch.Tensor, d: int,
        requests: list[DecodeRequest],
    ) -> tuple[torch.Tensor, torch.Tensor | None, None, list[int]]:  # fmt: skip
        """Up to d drafts a row by the head on (token, h), feeding its own state g back: the
        tokens [B, n], q [B, n, V] under sampling, no exit states, and each row's valid count
        (with ``threshold``, a row stops after a draft whose top-1 probability is at most it;
        the head stops once every row has). The head writes its cache layer past each row's
        start; the verify crops it back (``crop_rows``) and rewrites it from the true h."""
        hidden = self.h
        starts = [row.pos for row in rows]

        def step(token: torch.Tensor, i: int) -> torch.Tensor:
            nonlocal hidden
            out = runner.call_outputs("head", token, [s + i for s in starts], "draft",
                                      hidden=hidden)  # fmt: skip
            hidden = out["hidden"]  # [B, 1, D]
            return out["logits"][:, -1]  # [B, V]

        tokens, q, valid = draft_steps(step, x, d, requests, threshold=self.threshold)
        return tokens, q, None, valid


def _propose(
    runner: RowRunner,
    rows: list[Row],
    x: torch.Tensor,
    d: int,
    room: list[int],
    plan: BatchPlan,
    requests: list[DecodeRequest],
    matches: list[list[int]],
    eagle: _EagleRows | None = None,
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
        # (tokens [B, n], q or None, exit states or None, each row's valid count or None)
        if eagle is not None:
            staged = eagle.drafts(runner, rows, x, d, requests)
        else:
            staged = _stage_drafts(runner, rows, x, d, requests)
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


def _stage_drafts(
    runner: RowRunner, rows: list[Row], x: torch.Tensor, d: int, requests: list[DecodeRequest]
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, None]:
    """d drafts a row with the ``draft`` stage (``draft_steps``): tokens [B, d], under
    sampling q [B, d, V], and the exit states of the tokens fed (x .. t_{d-1}) [B, d, H] where
    the stage gives them (else None); every row's d drafts are valid (None)."""
    hidden = []
    starts = [row.pos for row in rows]

    def step(token: torch.Tensor, i: int) -> torch.Tensor:
        out = runner.call_outputs("draft", token, [s + i for s in starts], "draft")
        if "hidden" in out:
            hidden.append(out["hidden"])
        return out["logits"][:, -1]  # [B, V]

    tokens, q, _ = draft_steps(step, x, d, requests)
    return tokens, q, torch.cat(hidden, dim=1) if len(hidden) == d else None, None
