"""A batch's rows over one static KV cache: :class:`RowKVCache` (a fill length per row) and
:class:`RowRunner` (stage calls with each row at its own columns), what ``runtime.batch``'s
rounds run on.

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
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Mapping

import torch

from . import executor
from .cache import StaticKVCache, cache_for
from .executor import StageExecutor
from .masks import masks_for
from .runner import PREFILL, AttentionLayout

__all__ = ["ROW_PREFILL_PADDING", "RowKVCache", "RowRunner", "row_cache_for", "row_masks"]

# RowRunner.prefill: on a CPU, prompts whose padding is at least this share of the batch's
# columns are prefilled a row at a time (a call's cost follows its rows there, so padding is
# pure waste, and a row's call costs little more than its share of the padded one).
ROW_PREFILL_PADDING = 0.1


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
