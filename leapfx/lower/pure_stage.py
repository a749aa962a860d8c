"""The functions Inductor compiles: a stage as a pure function of the static cache's buffers.

A compiled stage cannot write the KV cache at Python-int fill lengths (each new length would be
a new shape, a recompile), so the executors of ``inductor.py`` compile these instead:

- :class:`PureStage`: a stage as a function of tensors, the cache's key and value buffers
  first; the masks are built in the graph from the positions over all ``max_len`` slots, and
  HF attention writes keys/values through a :class:`SlotKVCache` at the positions given as a
  tensor (``index_copy_``) and reads the whole buffer;
- :class:`RowsStage`: the same over a batch's ragged rows, each row written at its own cache
  columns (:class:`RowSlotKVCache`) and masked from them;
- :class:`ChainStage`: ``length`` greedy steps of the draft stage as one function (the
  compiled ``draft_chain``).

The module docstring of ``inductor.py`` says why the masked whole buffer is exact.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import fx

from ..runtime.cache import KVCache
from ..runtime.masks import column_masks, position_masks
from ..runtime.runner import AttentionLayout
from .chain import greedy_chain
from .stage_signature import POSITION_MASKS


class SlotKVCache(KVCache):
    """What HF attention sees inside a compiled stage: writes at tensor positions.

    ``update(k, v, layer)`` (``runtime.cache.KVCache``'s) copies ``k``/``v`` [B, H_kv, S, D]
    into the layer's buffers at the positions of the layer's group and returns the whole
    buffers [B, H_kv, max_len, D].
    """

    is_compileable = True
    whole_buffer = True  # update() returns every slot, not the filled prefix

    def __init__(
        self,
        keys: list[torch.Tensor],
        values: list[torch.Tensor],
        positions: Mapping[int, torch.Tensor],
    ) -> None:
        self.keys = keys
        self.values = values
        self.positions = positions

    def write(self, layer_idx: int, at: torch.Tensor, key_states, value_states) -> None:
        # at: [S], the positions of the layer's group
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        keys.index_copy_(2, at, key_states.to(keys.dtype))
        values.index_copy_(2, at, value_states.to(values.dtype))


class RowSlotKVCache(SlotKVCache):
    """:class:`SlotKVCache` for a batch's ragged rows (``runtime.rows.RowKVCache``): row b's
    keys and values go to its own cache columns (``columns[layer]`` [B, S]), and ``ragged``
    with :meth:`spans` lets kernel layers attend each row's own span
    (``leapfx_cpu::attention_rows``) instead of the mask over the whole buffer.

    >>> keys, values = [torch.zeros(2, 1, 6, 1)], [torch.zeros(2, 1, 6, 1)]
    >>> cache = RowSlotKVCache(keys, values, {0: torch.tensor([[1], [4]])}, torch.tensor([1, 3]))
    >>> k, _ = cache.update(torch.ones(2, 1, 1, 1), torch.ones(2, 1, 1, 1), 0)
    >>> k[:, 0, :, 0].tolist()
    [[0.0, 1.0, 0.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0, 1.0, 0.0]]
    """

    ragged = True

    def __init__(self, keys, values, columns: Mapping[int, torch.Tensor], first: torch.Tensor):
        super().__init__(keys, values, columns)
        self.first = first

    def write(self, layer_idx: int, at: torch.Tensor, key_states, value_states) -> None:
        # at: [B, S], each row's own columns
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        b, h = key_states.shape[:2]
        device = at.device
        index = (
            torch.arange(b, device=device)[:, None, None],
            torch.arange(h, device=device)[None, :, None],
            at[:, None, :],
        )  # [B, H, S] each, broadcast: row, head, column
        keys.index_put_(index, key_states.to(keys.dtype))
        values.index_put_(index, value_states.to(values.dtype))

    def spans(self, layer_idx: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's first real column [B] and its queries' columns [B, n]."""
        return self.first, self.positions[layer_idx]


class PureStage(torch.nn.Module):
    """A stage as a function of tensors: the cache's key and value buffers, then the inputs.

    ``groups`` maps each position input to the cache layers whose keys it positions (as
    ``stage_signature.discover`` finds them); ``layout`` says which masks to build.
    """

    def __init__(
        self,
        stage: fx.GraphModule,
        tensor_inputs: list[str],
        groups: dict[str, list[int]],
        layout: AttentionLayout,
    ) -> None:
        super().__init__()
        self.stage = stage
        self.tensor_inputs = tensor_inputs
        self.groups = groups
        self.layout = layout

    def forward(self, keys: list[torch.Tensor], values: list[torch.Tensor], *args: torch.Tensor):
        lay = self.layout
        named = dict(zip(self.tensor_inputs, args, strict=True))
        max_len = keys[0].shape[2]
        positions: dict[int, torch.Tensor] = {}
        inputs: dict[str, object] = dict(named)
        for pos_name, mask_name in POSITION_MASKS.items():
            if pos_name not in named:
                continue
            pos = named[pos_name]
            for layer in self.groups.get(pos_name, ()):
                positions[layer] = pos[0]
            inputs[mask_name] = position_masks(
                pos, max_len, kinds=lay.kinds, impl=lay.impl, window=lay.window, dtype=lay.dtype
            )
        return self.stage(**inputs, cache=SlotKVCache(keys, values, positions))


class RowsStage(torch.nn.Module):
    """``pure`` (a :class:`PureStage`) over a batch's ragged rows: a function of the cache's
    buffers, each row's first real column ``first`` [B], the stage's tensor inputs, then the
    cache columns [B, S] of each position input's tokens (``positions``' order). Keys and
    values are written at those columns (:class:`RowSlotKVCache`) and the masks come from them
    (``masks.column_masks``); the position inputs themselves still feed the rotary tables."""

    def __init__(self, pure: PureStage) -> None:
        super().__init__()
        self.pure = pure
        self.tensor_inputs = pure.tensor_inputs
        self.positions = [p for p in pure.tensor_inputs if p in POSITION_MASKS]

    def forward(self, keys, values, first: torch.Tensor, *args: torch.Tensor):
        lay = self.pure.layout
        n = len(self.tensor_inputs)
        inputs: dict[str, object] = dict(zip(self.tensor_inputs, args[:n], strict=True))
        columns: dict[int, torch.Tensor] = {}
        for pos_name, cols in zip(self.positions, args[n:], strict=True):
            for layer in self.pure.groups.get(pos_name, ()):
                columns[layer] = cols
            inputs[POSITION_MASKS[pos_name]] = column_masks(
                cols, first, keys[0].shape[2], kinds=lay.kinds, impl=lay.impl,
                window=lay.window, dtype=lay.dtype,
            )  # fmt: skip
        return self.pure.stage(**inputs, cache=RowSlotKVCache(keys, values, columns, first))


class ChainStage(torch.nn.Module):
    """``length`` greedy steps of the draft stage ``draft`` (a ``PureStage``) as one function:
    each step feeds the argmax of the one before at the next position. Returns the draft
    tokens [1, length] and the exit hidden states of the tokens fed [1, length, H]."""

    def __init__(self, draft: PureStage, length: int) -> None:
        super().__init__()
        self.draft = draft
        self.length = length

    def forward(self, keys, values, input_ids: torch.Tensor, position_ids: torch.Tensor):
        def step(ids, positions):
            named = {"input_ids": ids, "position_ids": positions}
            return self.draft(keys, values, *(named[n] for n in self.draft.tensor_inputs))

        return greedy_chain(step, input_ids, position_ids, self.length)
