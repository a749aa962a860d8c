"""A stage as a pure function of tensors: the KV cache buffers in and out, masks inside.

A stage GraphModule takes ``masks`` (a dict) and ``cache`` (a StaticKVCache, mutated in place);
neither can cross an ONNX boundary. :class:`ExportableStage` wraps the stage so that its inputs
and outputs are tensors only. The names follow optimum; the cache is static and updated in place
(the convention of onnxruntime-genai's shared past/present buffers):

- each cache layer ``i`` the stage touches becomes two inputs ``past_key_values.{i}.key`` /
  ``.value``: the whole preallocated buffer ``[B, H_kv, max_cache_len, D]`` whose slot ``j``
  holds position ``j``, and two outputs ``present.{i}.key`` / ``.value``: the same buffer with
  the stage's new keys/values written at their positions (one ``ScatterElements`` on the input
  buffer, nothing else reads it; ``onnx_optimize`` makes it a ``ScatterND`` of rows). A
  runtime binds input and output to ONE buffer (onnxruntime IO binding): the call then writes
  only the new positions and copies nothing else. :class:`SlotWriteKVCache` provides the
  ``update(k, v, layer_idx)`` call HF attention makes on a cache, so the stage runs unchanged;
- attention masks are computed in the graph from the position ids over all ``max_cache_len``
  slots, so an ONNX consumer feeds token ids, positions and the buffers and needs no HF mask
  logic: query ``q`` sees slot ``k`` iff ``k <= q`` (and ``k > q - window`` under a sliding
  window), the rule of ``runtime.masks.position_mask`` and of the compiled stages. Slots past
  a query, including stale ones left by rejected drafts, are masked; every slot ``<= q`` was
  written by a real token before any query reads it (the schedules write positions in order
  and roll back by lengths only). The mask is per batch row, from that row's positions; the
  keys are written at the first row's positions (the schedules decode one row).

In ``full`` and ``draft`` every layer runs ``position_ids``; in ``verify`` the layers below the
exit (and an adapter's slot) run ``position_ids`` and the layers from the exit up run
``remainder_position_ids``: each cache layer is written at its group's positions.
"""

from __future__ import annotations

import torch
from torch import fx, nn

from ..lower.stage_signature import (  # the discovery's cache and the names, imported from here
    FunctionalKVCache,
    past_names,  # noqa: F401
    present_names,  # noqa: F401
)
from ..runtime.masks import position_masks
from ..runtime.runner import AttentionLayout


class SlotWriteKVCache(FunctionalKVCache):
    """``update`` writes new keys/values into the whole buffers at their positions.

    Functional (``scatter``, not ``scatter_``): the written buffers are the presents, which the
    exporter turns into one ``ScatterElements`` from each past input to its present output.

    >>> past = {0: (torch.zeros(1, 2, 8, 4), torch.zeros(1, 2, 8, 4))}
    >>> cache = SlotWriteKVCache(past, {0: torch.tensor([3, 4])})
    >>> k, v = cache.update(torch.ones(1, 2, 2, 4), torch.ones(1, 2, 2, 4), 0)
    >>> k.shape, k[0, 0, :, 0].tolist()
    (torch.Size([1, 2, 8, 4]), [0.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.0])
    """

    def __init__(
        self,
        past: dict[int, tuple[torch.Tensor, torch.Tensor]],
        positions: dict[int, torch.Tensor],
    ) -> None:
        super().__init__(past)
        self.positions = positions  # cache layer -> the positions [S] its new keys go to

    def claim(self, layer_idx: int, n: int) -> torch.Tensor:
        super().claim(layer_idx, n)  # written once
        return self.positions[layer_idx]

    def write(self, layer_idx: int, at: torch.Tensor, key_states, value_states) -> None:
        # key_states: [B, H_kv, S, D] -> written into past [B, H_kv, max_cache_len, D] at [S]
        past_k, past_v = self.past[layer_idx]
        # scatter along the sequence axis with the index spelled out per element: it exports
        # as ScatterElements straight on the past buffer (index_copy adds two transposes,
        # i.e. two copies of the whole buffer).
        index = at.view(1, 1, -1, 1).expand_as(key_states)
        keys = past_k.scatter(2, index, key_states.to(past_k.dtype))
        values = past_v.scatter(2, index, value_states.to(past_v.dtype))
        self.present[layer_idx] = (keys, values)


class StageFunction(nn.Module):
    """A stage as a function of tensors that builds its own masks: ``cache_layers`` are the
    cache layers it touches, in the order of its flat ``past``/``present`` arguments, and
    ``layout`` the masks' kinds, attention implementation, window and dtype."""

    def __init__(
        self, stage: fx.GraphModule, *, cache_layers: list[int], layout: AttentionLayout
    ) -> None:
        super().__init__()
        self.stage = stage
        self.cache_layers = list(cache_layers)
        self.kinds = tuple(dict.fromkeys(layout.kinds))
        self.impl, self.window, self.dtype = layout.impl, layout.window, layout.dtype

    def pasts(self, flat) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """Each cache layer's (key, value) from the flat ``key, value`` arguments."""
        return {layer: (flat[2 * j], flat[2 * j + 1]) for j, layer in enumerate(self.cache_layers)}


class ExportableStage(StageFunction):
    """``stage`` with tensor-only inputs and outputs (see the module docstring).

    ``tensor_inputs``: the stage's tensor placeholders in order (``input_ids``, ``position_ids``
    and, for verify, ``exit_hidden``, ``remainder_position_ids``); ``groups`` maps each position
    input to the mask input it feeds (``position_ids -> masks``) and the cache layers whose
    keys it positions; ``cache_layers`` are the cache layers the stage touches, in the order of
    the flat ``past``/``present`` arguments; ``output_names`` the stage's dict outputs.
    """

    def __init__(
        self,
        stage: fx.GraphModule,
        *,
        tensor_inputs: list[str],
        groups: dict[str, tuple[str, list[int]]],
        cache_layers: list[int],
        output_names: list[str],
        layout: AttentionLayout,
    ) -> None:
        super().__init__(stage, cache_layers=cache_layers, layout=layout)
        self.tensor_inputs = list(tensor_inputs)
        self.groups = dict(groups)
        self.output_names = list(output_names)

    def forward(self, *args: torch.Tensor) -> tuple[torch.Tensor, ...]:
        n = len(self.tensor_inputs)
        named = dict(zip(self.tensor_inputs, args[:n], strict=True))
        if "remainder_position_ids" in named:
            # verify's remainder runs the cached exit states and the new tokens. Saying so lets
            # the exporter drop a free size (an export ~10% faster), and ONNX keeps no assert.
            c, m = named["exit_hidden"].shape[1], named["input_ids"].shape[1]
            torch._check(named["remainder_position_ids"].shape[1] == c + m)
        past = self.pasts(args[n:])
        positions: dict[int, torch.Tensor] = {}
        inputs: dict[str, object] = dict(named)
        for pos_name, (mask_input, layers) in self.groups.items():
            pos = named[pos_name]  # [B, S]
            for layer in layers:
                positions[layer] = pos[0]
            # A group without cache layers has no attention: its (unused) masks see nothing.
            kv_len = past[layers[0]][0].shape[2] if layers else pos.shape[1]
            inputs[mask_input] = position_masks(
                pos, kv_len, kinds=self.kinds, impl=self.impl, window=self.window,
                dtype=self.dtype,
            )  # fmt: skip
        cache = SlotWriteKVCache(past, positions)
        out = self.stage(**inputs, cache=cache)
        missing = set(self.cache_layers) - set(cache.present)
        assert not missing, f"cache layers {sorted(missing)} were fed but not written"
        presents = [t for layer in self.cache_layers for t in cache.present[layer]]
        return (*(out[name] for name in self.output_names), *presents)
