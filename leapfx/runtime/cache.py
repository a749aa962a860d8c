"""One static KV cache for the whole model, shared by every stage.

LayerSkip (sec. 4.3.3) keeps a single KV cache: the draft stage writes the lower layers' keys and
values, the verify stage writes the upper layers' (and the lower layers' for tokens the draft did
not run), and both read the same tensors. Keys and values live in tensors preallocated once
(``[B, H_kv, max_len, D]`` per layer); each layer keeps its own fill length because a verify call
writes different position ranges in different layers. Rejected tokens are rolled back by
``crop(length)``, which moves lengths and copies nothing.

Every cache a stage runs on speaks the one method HF attention modules call on a cache,
``update(key_states, value_states, layer_idx) -> (keys, values)``, so HF decoder layers run on it
unchanged. :class:`KVCache` implements it once for every backend; a backend supplies the write
into its storage (this one: views of the filled prefix, returned).

A SpeculativeModel allocates its cache once, at a maximum length, and between ``generate`` calls
only resets it (lengths to 0), so the buffers keep their addresses. On a GPU each buffer is also
marked with ``torch._dynamo.mark_static_address``: compiled stages update the cache in place, and
CUDA graph trees replay a graph that mutates an input only if the input is static (a parameter, a
buffer or a marked tensor); otherwise Inductor skips cudagraphs ("mutated inputs"). HF's
``StaticLayer`` marks its tensors for the same reason.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch


class KVCache:
    """The one cache protocol HF attention speaks, for every backend's storage.

    HF attention calls ``update(key_states, value_states, layer_idx, cache_kwargs)`` on its
    cache and attends to the keys and values it returns. Here that call is implemented once: it
    asks :meth:`claim` where the layer's new columns go (the bookkeeping: a fill length, or the
    positions a compiled or exported stage was given as tensors), hands them to :meth:`write`
    (the storage, the one thing each backend supplies) and returns :meth:`read`: the filled
    prefix of a cache that keeps lengths, the whole buffer of one written at positions
    (``whole_buffer``), the presents of a functional one.

    The users: :class:`StaticKVCache` (eager stages; its fill lengths from
    :class:`LayerLengths`), ``runtime.rows.RowKVCache`` (a fill length per row),
    ``lower.pure_stage.SlotKVCache`` and ``RowSlotKVCache`` (inside compiled stages: writes at
    tensor positions), ``lower.stage_signature.FunctionalKVCache`` and
    ``export.stage_module.SlotWriteKVCache`` (pure functions of the past, for discovery and
    export). ``lower.ort_stages.OrtKVCache`` keeps the lengths only: its sessions write the
    buffers themselves.
    """

    is_compileable = False  # read by HF code paths that ask; we are not an HF Cache
    whole_buffer = False  # update() returns every slot, not the filled prefix
    ragged = False  # a key's column is not its position (rows of a batch at their own columns)

    keys: Sequence
    values: Sequence
    positions: Mapping[int, torch.Tensor]

    def update(
        self,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        layer_idx: int,
        cache_kwargs: dict | None = None,
        **kwargs,  # transformers >= 5.24 passes the attention's kwargs (unused)
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # key_states, value_states: [B, H_kv, S_new, D]
        at = self.claim(layer_idx, key_states.shape[-2])
        self.write(layer_idx, at, key_states, value_states)
        return self.read(layer_idx)

    def claim(self, layer_idx: int, n: int) -> Any:
        """Where layer ``layer_idx``'s ``n`` new columns go, its bookkeeping moved past them;
        by default the positions the stage was given (``positions[layer_idx]``, a tensor)."""
        return self.positions[layer_idx]

    def write(
        self, layer_idx: int, at: Any, key_states: torch.Tensor, value_states: torch.Tensor
    ) -> None:
        """Store the new keys and values at ``at`` (what :meth:`claim` returned): the backend's
        hook."""
        raise NotImplementedError(f"{type(self).__name__} is written by its stages, not update()")

    def read(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """What attention reads after a write; by default the whole buffers [B, H_kv, L, D]."""
        return self.keys[layer_idx], self.values[layer_idx]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.keys[layer_idx].shape[2]


class LayerLengths(KVCache):
    """Per-layer fill lengths with O(1) rollback, shared by every backend's KV cache.

    Subclasses set ``keys`` (one buffer per cache layer), ``max_len`` and ``lengths``. A write
    claims the columns from the layer's fill length on (every row at the same columns; a batch
    of ragged rows keeps a length per row: ``runtime.rows.RowKVCache``) and reads the prefix.
    """

    keys: list
    max_len: int
    lengths: list[int]

    @property
    def num_layers(self) -> int:
        return len(self.keys)

    @property
    def length(self) -> int:
        """Tokens held by every layer (the committed prefix)."""
        return min(self.lengths)

    def check_room(self, end: int) -> None:
        """Refuse a write that would end past the buffers, before anything is written."""
        if end > self.max_len:
            raise ValueError(
                f"max_cache_len: the KV cache holds {self.max_len} positions but decoding needs "
                f"{end}; pass a larger max_cache_len"
            )

    def claim(self, layer_idx: int, n: int) -> int:
        """The layer's fill length (its new columns' first), the length moved ``n`` on."""
        start = self.lengths[layer_idx]
        self.check_room(start + n)
        self.lengths[layer_idx] = start + n
        return start

    def reserve(self, counts: Mapping[int, int], *, room: int = 0) -> dict[int, int]:
        """The fill length each layer of ``counts`` reaches with its ``counts[layer]`` new
        columns, refused (:meth:`check_room`) before anything is written where those, or
        ``room``, end past the buffers. A stage that writes the buffers itself (a compiled
        graph, an onnxruntime session) reserves before its call and :meth:`advance` after."""
        ends = {layer: self.lengths[layer] + n for layer, n in counts.items()}
        self.check_room(max(room, *ends.values()) if ends else room)
        return ends

    def advance(self, ends: Mapping[int, int]) -> None:
        """Move each layer of ``ends`` to its length there (what :meth:`reserve` returned)."""
        for layer, end in ends.items():
            self.lengths[layer] = end

    def read(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        end = self.lengths[layer_idx]
        return self.keys[layer_idx][:, :, :end], self.values[layer_idx][:, :, :end]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.lengths[layer_idx]

    def crop(self, length: int) -> None:
        """Forget every position >= ``length`` in every layer (O(1): moves lengths only)."""
        self.lengths = [min(n, length) for n in self.lengths]

    def crop_rows(self, ends: list[int]) -> None:
        """:meth:`crop` of a cache whose rows share one length (``ends``: a row's end each,
        all equal); a cache of ragged rows crops each row to its own."""
        if min(ends) != max(ends):
            raise ValueError(f"ends: {ends} differ; this cache's rows share one length")
        self.crop(ends[0])

    def reset(self) -> None:
        self.lengths = [0] * self.num_layers


class StaticKVCache(LayerLengths):
    """Preallocated per-layer key/value tensors with O(1) rollback.

    >>> cache = StaticKVCache(num_layers=2, num_kv_heads=1, head_dim=4, max_len=16)
    >>> k, v = cache.update(torch.zeros(1, 1, 3, 4), torch.zeros(1, 1, 3, 4), 0)
    >>> cache.lengths, k.shape
    ([3, 0], torch.Size([1, 1, 3, 4]))
    >>> cache.crop(2); cache.lengths
    [2, 0]
    """

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int | list[int],
        head_dim: int | list[int],
        max_len: int,
        *,
        batch_size: int = 1,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        static_addresses: bool | None = None,
    ) -> None:
        heads = num_kv_heads if isinstance(num_kv_heads, list) else [num_kv_heads] * num_layers
        dims = head_dim if isinstance(head_dim, list) else [head_dim] * num_layers
        self.max_len = max_len
        self.keys = [
            torch.zeros(batch_size, h, max_len, d, dtype=dtype, device=device)
            for h, d in zip(heads, dims, strict=True)
        ]
        self.values = [torch.zeros_like(k) for k in self.keys]
        self.lengths = [0] * num_layers
        # None: on CUDA only. On a CPU there are no graphs to replay, and a static input would
        # only change what Inductor assumes about the CPU stages' inputs.
        if static_addresses is None:
            static_addresses = torch.device(device).type == "cuda"
        self.static_addresses = static_addresses
        if static_addresses:
            for t in (*self.keys, *self.values):
                # guard=False: no address guard; the cache is reset between calls, never
                # reallocated within one (SpeculativeModel._cache_for).
                torch._dynamo.mark_static_address(t, guard=False)

    def write(self, layer_idx: int, at: int, key_states, value_states) -> None:
        # every row at the same columns at .. at + S_new
        end = at + key_states.shape[-2]
        self.keys[layer_idx][:, :, at:end] = key_states
        self.values[layer_idx][:, :, at:end] = value_states

    @property
    def appends(self) -> bool:
        """Whether ``update`` writes at the layer's fill length and returns the filled prefix
        (this class's claim, write and read): then a kernel layer may write the cache buffers
        itself and move ``lengths`` as ``update`` would (``modules.block_layer``). A subclass
        with a protocol step of its own (a batch's ragged rows) does not."""
        cls = type(self)
        steps = ("update", "claim", "write", "read")
        return not self.ragged and all(getattr(cls, n) is getattr(StaticKVCache, n) for n in steps)


def cache_for(
    model,
    max_len: int,
    *,
    extra_layers: int = 0,
    dtype=None,
    device=None,
    static_addresses: bool | None = None,
    cache_type: type[StaticKVCache] | None = None,
    **cache_options,
) -> StaticKVCache:
    """A cache shaped for ``model`` (a supported HF causal LM): a ``cache_type`` (default
    ``StaticKVCache``) built with ``cache_options`` too (a batch's ``RowKVCache`` takes its
    ``batch_size``).

    ``extra_layers`` cache layers past the model's own layers serve attention blocks a rewrite
    added (the Kangaroo adapter writes cache layer ``num_hidden_layers``); they have the model's
    KV shape and roll back with the rest. ``static_addresses`` (None: on CUDA) marks the buffers
    for CUDA graphs (see the module docstring).
    """
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    param = next(model.parameters())
    return (cache_type or StaticKVCache)(
        config.num_hidden_layers + extra_layers,
        kv_heads,
        head_dim,
        max_len,
        dtype=dtype or param.dtype,
        device=device or param.device,
        static_addresses=static_addresses,
        **cache_options,
    )
