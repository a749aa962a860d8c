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


def _addresses(cache) -> list[int]:
    return [t.data_ptr() for t in (*cache.keys, *cache.values)]


@pytest.mark.parametrize(
    "recipe, options",
    [
        ("autoregressive", {}),
        ("layerskip", {"exit_layer": 2, "num_speculations": 3}),
        ("kangaroo", {"exit_layer": 1, "max_draft_tokens": 3}),  # + the adapter's slot
    ],
)
def test_one_cache_per_model_reused_across_calls_of_different_lengths(recipe, options):
    from leapfx import rewrite
    from tests.conftest import tiny_model

    sm = rewrite.apply(tiny_model("llama", layers=4), recipe, max_cache_len=96, **options)
    calls = [([5, 17, 42], 40), ([9] * 30, 60), ([64], 3), ([1, 2, 3, 4, 5, 6], 80)]
    sm.generate(torch.tensor([calls[0][0]]), max_new_tokens=calls[0][1])
    cache = sm._cache
    addresses = _addresses(cache)
    assert cache.max_len == 96
    assert cache.num_layers == 4 + (recipe == "kangaroo")
    for prompt, n in calls[1:]:
        sm.generate(torch.tensor([prompt]), max_new_tokens=n)
        assert sm._cache is cache and _addresses(cache) == addresses  # reset, never reallocated
        assert cache.length >= len(prompt) + sm.last_metrics.new_tokens - 1
    assert sm._cache_for(10) is cache and cache.lengths == [0] * cache.num_layers  # reset
    with pytest.raises(ValueError, match="max_cache_len"):
        sm.generate(torch.tensor([[1] * 50]), max_new_tokens=50)
    assert sm._cache is cache and _addresses(cache) == addresses


def test_auto_sized_cache_grows_only_past_its_maximum_and_says_so(caplog):
    from leapfx import rewrite
    from tests.conftest import tiny_model

    sm = rewrite.apply(tiny_model("llama", layers=2), "autoregressive")
    sm.generate(torch.tensor([[3, 4]]), max_new_tokens=100)
    cache = sm._cache
    assert cache.max_len == 256  # rounded up (leapfx.runtime.decode.CACHE_ROUNDING)
    addresses = _addresses(cache)
    with caplog.at_level("INFO", logger="leapfx.runtime.model"):
        sm.generate(
            torch.tensor([[3] * 20]), max_new_tokens=200
        )  # 221 positions (1 lookahead): fits
        assert sm._cache is cache and _addresses(cache) == addresses and not caplog.records
        sm.generate(torch.tensor([[3] * 20]), max_new_tokens=250)  # 271: past the maximum
    assert sm._cache.max_len == 512
    assert "KV cache: 271 positions needed, 256 allocated; reallocating 512" in caplog.text


def test_static_addresses_marked_on_cuda_only_by_default():
    cache = StaticKVCache(num_layers=2, num_kv_heads=1, head_dim=4, max_len=8)
    assert cache.static_addresses is False
    assert not any(hasattr(t, "_dynamo_static_input_type") for t in cache.keys)
    with torch.inference_mode():  # as SpeculativeModel allocates it
        marked = StaticKVCache(2, 1, 4, 8, static_addresses=True)
    assert all(t._dynamo_static_input_type == "unguarded" for t in (*marked.keys, *marked.values))


@pytest.mark.gpu
def test_cuda_cache_is_marked_static():
    from leapfx import rewrite
    from tests.conftest import tiny_model

    sm = rewrite.apply(tiny_model("llama", layers=2).cuda(), "layerskip", exit_layer=1)
    sm.generate(torch.tensor([[3, 4, 5]], device="cuda"), max_new_tokens=8)
    cache = sm._cache
    assert cache.static_addresses is True
    static = [getattr(t, "_dynamo_static_input_type", None) for t in (*cache.keys, *cache.values)]
    assert static == ["unguarded"] * (2 * cache.num_layers)
