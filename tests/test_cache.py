"""The shared static KV cache: preallocated, per-layer lengths, O(1) rollback."""

from __future__ import annotations

import pytest
import torch

from leapfx.runtime.cache import StaticKVCache


def test_update_returns_filled_prefix_and_crop_moves_lengths_only():
    cache = StaticKVCache(num_layers=2, num_kv_heads=2, head_dim=3, max_len=8)
    k_ptr = cache.keys[0].data_ptr()
    k1 = torch.randn(1, 2, 5, 3)
    k, v = cache.update(k1, k1 + 1, 0)
    assert k.shape == (1, 2, 5, 3) and torch.equal(k, k1) and torch.equal(v, k1 + 1)
    assert cache.lengths == [5, 0] and cache.length == 0
    cache.crop(3)
    assert cache.lengths == [3, 0]
    assert cache.keys[0].data_ptr() == k_ptr  # nothing reallocated or copied
    k2 = torch.randn(1, 2, 2, 3)
    k, _ = cache.update(k2, k2, 0)
    assert torch.equal(k[:, :, :3], k1[:, :, :3]) and torch.equal(k[:, :, 3:], k2)


def test_overflow_names_the_option():
    cache = StaticKVCache(num_layers=1, num_kv_heads=1, head_dim=2, max_len=4)
    with pytest.raises(ValueError, match="max_cache_len"):
        cache.update(torch.zeros(1, 1, 5, 2), torch.zeros(1, 1, 5, 2), 0)
