"""``BlockDecoderLayer`` (``leapfx_cpu::block_decoder_layer``): a kernel layer over GGUF blocks
as one call.

Over the block formats, 1..8 query rows and random cache fills, the one call gives bitwise the
numbers of the eager kernel layer's ~10 calls (``KernelDecoderLayer``'s per-op path) and
writes the same keys and values into the same cache slots; the fill lengths move as
``StaticKVCache.update`` moves them. A layer the op does not compute (float weights, biases,
q/k norms) keeps the per-op path.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from leapfx.kernels import cpu_attention, cpu_blocks
from leapfx.modules.block_layer import BlockDecoderLayer, kernel_decoder_layer
from leapfx.modules.blocks import quantized_copy
from leapfx.modules.fused import FusedDecoderLayer
from leapfx.modules.kernel_layers import KernelDecoderLayer
from leapfx.runtime.cache import StaticKVCache
from tests.conftest import tiny_model

pytestmark = pytest.mark.skipif(
    not (cpu_blocks.available() and cpu_attention.available()),
    reason="the leapfx_cpu block and attention kernels did not build here",
)


def block_layer(fmt: str, arch: str = "llama", seed: int = 0) -> tuple[BlockDecoderLayer, object]:
    # head_dim 32: hidden 128 and intermediate 256, multiples of 32 (a block's weights)
    model = tiny_model(arch, layers=1, heads=4, kv_heads=2, head_dim=32, seed=seed)
    layer, count, _ = quantized_copy(model.model.layers[0], fmt)
    assert count == 7
    kernel = kernel_decoder_layer(layer)
    assert type(kernel) is BlockDecoderLayer
    return kernel, model


def run(layer, model, x, start, cache, *, whole: bool):
    pos = torch.arange(start, start + x.shape[1])[None]
    rope = model.model.rotary_emb(x, pos)
    saved = layer._whole
    if not whole:
        layer._whole = None
    try:
        with torch.no_grad():
            return layer(x, None, rope, pos, cache)
    finally:
        layer._whole = saved


@settings(max_examples=30, deadline=None)
@given(
    fmt=st.sampled_from(cpu_blocks.QUANTIZABLE),
    rows=st.integers(1, 8),
    start=st.integers(0, 40),
    seed=st.integers(0, 2**16),
)
def test_one_call_is_the_eager_kernel_layer_bitwise(fmt, rows, start, seed):
    layer, model = block_layer(fmt, seed=seed % 7)
    assert layer._whole is not None
    gen = torch.Generator().manual_seed(seed)
    prefix = torch.randn(1, 2, 64, 32, generator=gen), torch.randn(1, 2, 64, 32, generator=gen)
    x = torch.randn(1, rows, 128, generator=gen)
    outs, caches = [], []
    for whole in (True, False):
        cache = StaticKVCache(1, 2, 32, 64)
        cache.keys[0].copy_(prefix[0]), cache.values[0].copy_(prefix[1])
        cache.lengths = [start]
        outs.append(run(layer, model, x, start, cache, whole=whole))
        caches.append(cache)
    assert torch.equal(outs[0], outs[1])
    assert caches[0].lengths == caches[1].lengths == [start + rows]
    assert torch.equal(caches[0].keys[0], caches[1].keys[0])
    assert torch.equal(caches[0].values[0], caches[1].values[0])


def test_one_call_is_the_float_layer_up_to_summation_order():
    layer, model = block_layer("Q8_0")
    float_layer = FusedDecoderLayer(quantized_copy_as_float(layer.layer))
    x = torch.randn(1, 3, 128)
    out = []
    for mod in (layer, float_layer):
        cache = StaticKVCache(1, 2, 32, 16)
        out.append(run(mod, model, x, 0, cache, whole=True) if mod is layer else None)
        if mod is float_layer:
            pos = torch.arange(3)[None]
            mask = torch.full((3, 3), float("-inf")).triu(1)[None, None]
            with torch.no_grad():
                out[-1] = mod(x, mask, model.model.rotary_emb(x, pos), pos, cache)
    torch.testing.assert_close(out[0], out[1], rtol=1e-5, atol=1e-5)


def quantized_copy_as_float(layer):
    """``layer`` with each block linear as an nn.Linear over its dequantized weight."""
    import copy

    from leapfx.modules.blocks import BlockLinear

    out = copy.deepcopy(layer)
    for name, mod in list(out.named_modules()):
        if isinstance(mod, BlockLinear):
            lin = torch.nn.Linear(mod.in_features, mod.out_features, bias=False)
            lin.weight = torch.nn.Parameter(mod.weight, requires_grad=False)
            out.set_submodule(name, lin)
    return out


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_layers_the_op_does_not_compute_keep_their_calls(arch):
    # qwen2: q/k/v biases; qwen3: q/k norms
    layer, _ = block_layer("Q8_0", arch)
    assert layer._whole is None


def test_float_layers_keep_their_calls():
    model = tiny_model("llama", layers=1, heads=4, kv_heads=2, head_dim=32)
    assert type(kernel_decoder_layer(model.model.layers[0])) is KernelDecoderLayer


def test_a_ragged_cache_keeps_the_calls():
    class Ragged(StaticKVCache):
        def update(self, *args, **kwargs):
            return super().update(*args, **kwargs)

    from leapfx.runtime.rows import RowKVCache

    class RaggedOwn(RowKVCache):
        def write(self, *args, **kwargs):
            return super().write(*args, **kwargs)

    assert StaticKVCache(1, 2, 32, 8).appends
    assert not Ragged(1, 2, 32, 8).appends
    # a batch's rows: the one update(), over a per-row claim and write of its own: the one
    # call takes them as rows (appends_rows), and a subclass with its own step not at all
    assert not RowKVCache(1, 2, 32, 8, batch_size=2).appends
    assert RowKVCache(1, 2, 32, 8, batch_size=2).appends_rows
    assert not RaggedOwn(1, 2, 32, 8, batch_size=2).appends_rows
    assert not getattr(StaticKVCache(1, 2, 32, 8), "appends_rows", False)


@settings(max_examples=25, deadline=None)
@given(
    fmt=st.sampled_from(cpu_blocks.QUANTIZABLE),
    batch=st.integers(1, 4),
    rows=st.integers(1, 6),
    seed=st.integers(0, 2**16),
    data=st.data(),
)
def test_a_batchs_ragged_rows_are_the_calls_bitwise(fmt, batch, rows, seed, data):
    # a batch's rows at their own fill lengths after their own left padding (RowKVCache): the
    # one call writes each row's columns where RowKVCache.update does and attends each row's
    # span as leapfx_cpu::attention_rows does, bitwise
    from leapfx.runtime.rows import RowKVCache

    layer, model = block_layer(fmt, seed=seed % 7)
    gen = torch.Generator().manual_seed(seed)
    fills = data.draw(st.lists(st.integers(0, 30), min_size=batch, max_size=batch))
    first = [data.draw(st.integers(0, f)) for f in fills]
    prefix = (
        torch.randn(batch, 2, 40, 32, generator=gen),
        torch.randn(batch, 2, 40, 32, generator=gen),
    )
    x = torch.randn(batch, rows, 128, generator=gen)
    pos = torch.tensor(
        [[f - a + s for s in range(rows)] for f, a in zip(fills, first, strict=True)]
    )
    rope = model.model.rotary_emb(x, pos)
    outs, caches = [], []
    for whole in (True, False):
        cache = RowKVCache(1, 2, 32, 40, batch_size=batch)
        cache.keys[0].copy_(prefix[0]), cache.values[0].copy_(prefix[1])
        cache.rows, cache.first, cache.lengths = [list(fills)], list(first), [max(fills)]
        saved, per_op = layer._whole, KernelDecoderLayer.forward
        layer._whole = saved if whole else None
        if whole:  # the one call, not the fallback to the per-op path
            KernelDecoderLayer.forward = None
        try:
            with torch.no_grad():
                outs.append(layer(x, None, rope, pos, cache))
        finally:
            layer._whole, KernelDecoderLayer.forward = saved, per_op
        caches.append(cache)
    assert torch.equal(outs[0], outs[1])
    assert caches[0].rows == caches[1].rows == [[f + rows for f in fills]]
    assert caches[0].lengths == caches[1].lengths
    assert torch.equal(caches[0].keys[0], caches[1].keys[0])
    assert torch.equal(caches[0].values[0], caches[1].values[0])


def test_a_long_prefix_and_a_prefill_are_the_calls_bitwise():
    # several rows over a long prefix; a prefill's rows (kGemmRows or more: float32 GEMM over
    # the dequantized blocks, in the one call and in each per-op product alike)
    layer, model = block_layer("Q4_1")
    for start, rows in ((300, 3), (0, 3), (0, 40), (250, 33)):
        x = torch.randn(1, rows, 128)
        outs, caches = [], []
        for whole in (True, False):
            cache = StaticKVCache(1, 2, 32, 320)
            cache.lengths = [start]
            pos = torch.arange(start, start + rows)[None]
            mask = torch.zeros(1, 1, rows, start + rows)
            rope = model.model.rotary_emb(x, pos)
            saved = layer._whole
            layer._whole = saved if whole else None
            with torch.no_grad():
                outs.append(layer(x, mask, rope, pos, cache))
            layer._whole = saved
            caches.append(cache)
        assert torch.equal(outs[0], outs[1])
        assert torch.equal(caches[0].keys[0], caches[1].keys[0])
        assert torch.equal(caches[0].values[0], caches[1].values[0])


def test_decoding_a_block_model_calls_the_layer_op_and_keeps_its_tokens():
    from leapfx import rewrite

    model = tiny_model("llama", layers=2, heads=4, kv_heads=2, head_dim=32)
    blocks, _, _ = quantized_copy(model, "Q4_1")
    sm = rewrite.apply(blocks, "autoregressive", cpu_kernels=True)
    stages = sm._executors.values()
    layers = {m for s in stages for m in s.modules() if isinstance(m, BlockDecoderLayer)}
    assert layers and all(m._whole is not None for m in layers)
    ids = torch.tensor([[5, 9, 30, 70, 100]])
    got = sm.generate(ids, max_new_tokens=12)
    for m in layers:
        m._whole = None
    assert torch.equal(sm.generate(ids, max_new_tokens=12), got)
