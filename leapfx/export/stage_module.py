"""A stage as a pure function of tensors: explicit KV cache in, presents out, masks inside.

A stage GraphModule takes ``masks`` (a dict) and ``cache`` (a StaticKVCache, mutated in place);
neither can cross an ONNX boundary. :class:`ExportableStage` wraps the stage so that its inputs
and outputs are tensors only, following the optimum convention:

- each cache layer ``i`` the stage touches becomes two inputs ``past_key_values.{i}.key`` /
  ``.value`` ([B, H_kv, past, D]) and two outputs ``present.{i}.key`` / ``.value``
  ([B, H_kv, past + S, D], past and new concatenated). :class:`FunctionalKVCache` provides the
  ``update(k, v, layer_idx)`` call HF attention makes on a cache, so the stage runs unchanged;
- attention masks are computed in the graph from the position ids and the past length
  (``runtime.masks.position_masks``), so an ONNX consumer feeds token ids, positions and past
  keys/values and needs no HF mask logic. Keys of a layer sit at positions
  ``0 .. past + S - 1`` (the cache is filled from position 0, rollback only shortens it), so
  query ``q`` sees key ``k`` iff
  ``k <= q`` (and ``k > q - window`` under a sliding window): the same rule as
  ``runtime.masks.chunk_mask``, always explicit. The mask is per batch row, from that row's
  positions.

Every attention layer sharing one mask reads the same past length: in ``full`` and ``draft`` all
layers run the same positions; in ``verify`` the layers below the exit (and an adapter's slot)
run ``position_ids`` and the layers from the exit up run ``remainder_position_ids``. So each
position input takes its past length from the first cache layer of its group.
"""

from __future__ import annotations

import torch
from torch import fx, nn

from ..runtime.masks import position_masks


class FunctionalKVCache:
    """``update`` concatenates past and new keys/values and records them as the presents.

    >>> past = {0: (torch.zeros(1, 2, 3, 4), torch.zeros(1, 2, 3, 4))}
    >>> cache = FunctionalKVCache(past)
    >>> k, v = cache.update(torch.ones(1, 2, 1, 4), torch.ones(1, 2, 1, 4), 0)
    >>> k.shape, sorted(cache.present)
    (torch.Size([1, 2, 4, 4]), [0])
    """

    is_compileable = False  # read by HF code paths that ask; we are not an HF Cache

    def __init__(self, past: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.past = past
        self.present: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def update(
        self,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        layer_idx: int,
        cache_kwargs: dict | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # key_states: [B, H_kv, S, D]; past: [B, H_kv, P, D] -> [B, H_kv, P + S, D]
        assert layer_idx not in self.present, f"cache layer {layer_idx} written twice in a stage"
        past_k, past_v = self.past[layer_idx]
        keys = torch.cat([past_k, key_states], dim=2)
        values = torch.cat([past_v, value_states], dim=2)
        self.present[layer_idx] = (keys, values)
        return keys, values

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.past[layer_idx][0].shape[2]


def past_names(layer: int) -> tuple[str, str]:
    return f"past_key_values.{layer}.key", f"past_key_values.{layer}.value"


def present_names(layer: int) -> tuple[str, str]:
    return f"present.{layer}.key", f"present.{layer}.value"


class ExportableStage(nn.Module):
    """``stage`` with tensor-only inputs and outputs (see the module docstring).

    ``tensor_inputs``: the stage's tensor placeholders in order (``input_ids``, ``position_ids``
    and, for verify, ``exit_hidden``, ``remainder_position_ids``); ``groups`` maps each position
    input to the mask input it feeds (``position_ids -> masks``) and the cache layer whose past
    length sizes that mask (None: no attention reads it); ``cache_layers`` are the cache layers
    the stage touches, in the order of the flat ``past``/``present`` arguments;
    ``output_names`` the stage's dict outputs.
    """

    def __init__(
        self,
        stage: fx.GraphModule,
        *,
        tensor_inputs: list[str],
        groups: dict[str, tuple[str, int | None]],
        cache_layers: list[int],
        output_names: list[str],
        kinds: tuple[str, ...],
        impl: str,
        window: int | None,
        dtype: torch.dtype,
    ) -> None:
        super().__init__()
        self.stage = stage
        self.tensor_inputs = list(tensor_inputs)
        self.groups = dict(groups)
        self.cache_layers = list(cache_layers)
        self.output_names = list(output_names)
        self.kinds = tuple(dict.fromkeys(kinds))
        self.impl = impl
        self.window = window
        self.dtype = dtype

    def forward(self, *args: torch.Tensor) -> tuple[torch.Tensor, ...]:
        n = len(self.tensor_inputs)
        named = dict(zip(self.tensor_inputs, args[:n], strict=True))
        if "remainder_position_ids" in named:
            # verify's remainder runs the cached exit states and the new tokens. Saying so lets
            # the exporter drop a free size (an export ~10% faster), and ONNX keeps no assert.
            c, m = named["exit_hidden"].shape[1], named["input_ids"].shape[1]
            torch._check(named["remainder_position_ids"].shape[1] == c + m)
        flat = args[n:]
        past = {layer: (flat[2 * j], flat[2 * j + 1]) for j, layer in enumerate(self.cache_layers)}
        cache = FunctionalKVCache(past)
        inputs: dict[str, object] = dict(named)
        for positions, (mask_input, layer) in self.groups.items():
            # A group without cache layers has no attention: its (unused) masks see no past.
            past_len = 0 if layer is None else past[layer][0].shape[2]
            kv_len = past_len + named[positions].shape[1]
            inputs[mask_input] = position_masks(
                named[positions], kv_len, kinds=self.kinds, impl=self.impl,
                window=self.window, dtype=self.dtype,
            )  # fmt: skip
        out = self.stage(**inputs, cache=cache)
        missing = set(self.cache_layers) - set(cache.present)
        assert not missing, f"cache layers {sorted(missing)} were fed but not written"
        presents = [t for layer in self.cache_layers for t in cache.present[layer]]
        return (*(out[name] for name in self.output_names), *presents)
