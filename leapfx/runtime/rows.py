"""A batch's rows over one static KV cache: :class:`RowKVCache`, a fill length per row.

Layout. Row b's prompt is left-padded by ``pad_b`` tokens, so its token at position p sits in
cache column ``pad_b + p``: HF's layout for a left-padded batch. Every layer keeps a fill length
per row: a call writes row b's new keys and values at that row's own length (one slice write
while the rows are aligned, one ``index_put`` when they are not) and reads the columns up to the
longest row's end; the mask (``masks.row_masks``, from each row's query columns and its padding)
hides this row's padding and every column past this row's own end. Rollback is per row and
O(1): ``crop_rows`` moves lengths, nothing is copied. With the CPU kernels, attention reads each
row's own span of columns (``leapfx_cpu::attention_rows`` over :meth:`RowKVCache.spans`)
instead of attending through the mask. Rows leave (``keep``), and rows prefilled alone in a
one-row cache of the same shape (``blank``) join (``join``), between rounds.

The ``runner.StageRunner`` over such a cache calls its stages with each row at its own columns
(``start`` arguments one a row) and prefills the rows (one call over the padded batch, or a call
a row over ``row_view``).

Why a single sequence's cache is not this one at B = 1: its rows share one fill length, so its
bookkeeping is an int a layer (this one's is a list a layer, built on every write), kernel
layers write it at one column and attend by position (``StaticKVCache.appends``; ``ragged``
here), and the compiled and ONNX Runtime caches that mirror it (``lower.inductor.SlotKVCache``,
``lower.onnxruntime.OrtKVCache``) keep one length too.
"""

from __future__ import annotations

import torch

from .cache import StaticKVCache, cache_for

__all__ = ["RowKVCache", "row_cache_for"]


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
