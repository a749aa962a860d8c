"""One static KV cache for the whole model, shared by every stage.

LayerSkip (sec. 4.3.3) keeps a single KV cache: the draft stage writes the lower layers' keys and
values, the verify stage writes the upper layers' (and the lower layers' for tokens the draft did
not run), and both read the same tensors. Keys and values live in tensors preallocated once
(``[B, H_kv, max_len, D]`` per layer); each layer keeps its own fill length because a verify call
writes different position ranges in different layers. Rejected tokens are rolled back by
``crop(length)``, which moves lengths and copies nothing.

The class speaks the one method HF attention modules call on a cache,
``update(key_states, value_states, layer_idx) -> (keys, values)``, so HF decoder layers run on it
unchanged; it returns views of the filled prefix.

A SpeculativeModel allocates its cache once, at a maximum length, and between ``generate`` calls
only resets it (lengths to 0), so the buffers keep their addresses. On a GPU each buffer is also
marked with ``torch._dynamo.mark_static_address``: compiled stages update the cache in place, and
CUDA graph trees replay a graph that mutates an input only if the input is static (a parameter, a
buffer or a marked tensor); otherwise Inductor skips cudagraphs ("mutated inputs"). HF's
``StaticLayer`` marks its tensors for the same reason.
"""

from __future__ import annotations

import torch


class LayerLengths:
    """Per-layer fill lengths with O(1) rollback, shared by every backend's KV cache.

    Subclasses set ``keys`` (one buffer per cache layer), ``max_len`` and ``lengths``.
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

    def crop(self, length: int) -> None:
        """Forget every position >= ``length`` in every layer (O(1): moves lengths only)."""
        self.lengths = [min(n, length) for n in self.lengths]

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

    is_compileable = False  # read by HF code paths that ask; we are not an HF Cache

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

    def update(
        self,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        layer_idx: int,
        cache_kwargs: dict | None = None,
        **kwargs,  # transformers >= 5.24 passes the attention's kwargs (unused)
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # key_states, value_states: [B, H_kv, S_new, D]; written at this layer's fill length.
        start = self.lengths[layer_idx]
        end = start + key_states.shape[-2]
        self.check_room(end)
        self.keys[layer_idx][:, :, start:end] = key_states
        self.values[layer_idx][:, :, start:end] = value_states
        self.lengths[layer_idx] = end
        return self.keys[layer_idx][:, :, :end], self.values[layer_idx][:, :, :end]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.lengths[layer_idx]

    @property
    def appends(self) -> bool:
        """Whether ``update`` is this class's own (write at the layer's fill length, return
        the filled prefix): then a kernel layer may write the cache buffers itself and move
        ``lengths`` as ``update`` would (``modules.fused.KernelDecoderLayer``). A subclass
        with its own ``update`` (a batch's ragged rows) is not."""
        return type(self).update is StaticKVCache.update


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
