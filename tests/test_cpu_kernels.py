"""The leapfx_cpu small-M kernels (leapfx/kernels/cpu_gemm.cpp) and the layers that use them.

The extension is built on first use with the machine's compiler; CI has one, so a failed build
fails these tests instead of skipping them.
"""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_model
from greedy_check import check_random_prompts
from hypothesis import given, settings
from hypothesis import strategies as st

from leapfx import rewrite
from leapfx.bench.harness import BenchConfig, use_cpu_kernels
from leapfx.kernels import cpu
from leapfx.lower.inductor import CompileOptions
from leapfx.modules.fused import FusedDecoderLayer
from leapfx.modules.kernel_layers import (
    KernelDecoderLayer,
    KernelLinear,
    KernelRMSNorm,
    RotaryTable,
)
from tests.conftest import examples


@pytest.fixture(scope="module", autouse=True)
def built():
    assert cpu.available(), "the leapfx_cpu kernels did not build (see the logged warning)"


def test_pack_weight_blocks_columns_and_pads_with_zeros():
    w = torch.arange(20 * 3, dtype=torch.float32).view(20, 3)  # [N=20, K=3]
    p = cpu.pack_weight(w)
    assert p.shape == (2, 3, 16) and p.is_contiguous()
    assert torch.equal(p[0], w[:16].t())
    assert torch.equal(p[1, :, :4], w[16:].t())
    assert not p[1, :, 4:].any()


@settings(max_examples=examples(60, 240), deadline=None)
@given(
    m=st.integers(1, 20),
    k=st.integers(1, 70),
    n=st.integers(1, 300),  # up to 19 column blocks: every blocks-at-once width and tail
    lead=st.sampled_from([(), (2,), (1, 3)]),
    seed=st.integers(0, 2**16),
)
def test_small_mm_matches_matmul(m, k, n, lead, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*lead, m, k, generator=g)
    w = torch.randn(n, k, generator=g)
    got = torch.ops.leapfx_cpu.small_mm(x, cpu.pack_weight(w), n)
    assert got.shape == (*lead, m, n)
    torch.testing.assert_close(got, x @ w.t(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("m", "k", "n"),
    [
        (7, 192, 259),
        # more rows than the registers hold, and a K whose column blocks go a few at a time
        # (the chunks of matmul_rows), the last chunk short: 19 blocks of 16 columns
        (13, 1100, 300),
    ],
)
def test_a_rows_result_does_not_depend_on_the_other_rows(m, k, n):
    # The property the verify pass relies on: row i of an m-row product is bitwise the
    # one-row product of row i (same operations, same order).
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g)
    wp = cpu.pack_weight(w)
    rows = torch.ops.leapfx_cpu.small_mm(x, wp, n)
    torch.testing.assert_close(rows, x @ w.t(), rtol=1e-4, atol=1e-4)
    for i in range(m):
        assert torch.equal(rows[i : i + 1], torch.ops.leapfx_cpu.small_mm(x[i : i + 1], wp, n))


def test_small_mm_reads_a_non_contiguous_input():
    x = torch.randn(16, 5).t()  # [5, 16], strides (1, 5)
    w = torch.randn(24, 16)
    torch.testing.assert_close(cpu.small_mm(x, w), x @ w.t(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [1, 5, 9])
def test_gated_mlp_matches_torch(rows):
    g = torch.Generator().manual_seed(rows)
    gate, up = torch.randn(40, 24, generator=g), torch.randn(40, 24, generator=g)
    down = torch.randn(24, 40, generator=g)
    x = torch.randn(1, rows, 24, generator=g)
    want = (torch.nn.functional.silu(x @ gate.t()) * (x @ up.t())) @ down.t()
    torch.testing.assert_close(cpu.gated_mlp(x, gate, up, down), want, rtol=1e-4, atol=1e-4)


def test_bad_inputs_are_refused_with_the_reason():
    wp = cpu.pack_weight(torch.randn(20, 8))
    with pytest.raises(RuntimeError, match="float32 only"):
        torch.ops.leapfx_cpu.small_mm(torch.randn(2, 8, dtype=torch.float64), wp, 20)
    with pytest.raises(RuntimeError, match="does not match the weight's K=8"):
        torch.ops.leapfx_cpu.small_mm(torch.randn(2, 9), wp, 20)
    with pytest.raises(RuntimeError, match="n=40 does not match 2 column blocks"):
        torch.ops.leapfx_cpu.small_mm(torch.randn(2, 8), wp, 40)
    with pytest.raises(RuntimeError, match="must be packed"):
        torch.ops.leapfx_cpu.small_mm(torch.randn(2, 8), torch.randn(8, 20), 20)


@settings(max_examples=examples(40, 160), deadline=None)
@given(rows=st.integers(1, 9), h=st.integers(1, 70), offset=st.sampled_from([0.0, 1.0]),
       seed=st.integers(0, 2**16))  # fmt: skip
def test_rms_norm_op_matches_torch_and_rows_are_independent(rows, h, offset, seed):
    g = torch.Generator().manual_seed(seed)
    x, w = torch.randn(1, rows, h, generator=g), torch.randn(h, generator=g)
    got = torch.ops.leapfx_cpu.rms_norm(x, w, 1e-6, offset)
    want = torch.nn.functional.rms_norm(x, (h,), w + offset, 1e-6)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for r in range(rows):  # a row alone gives the same bits as among the others
        assert torch.equal(torch.ops.leapfx_cpu.rms_norm(x[:, r], w, 1e-6, offset), got[:, r])


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_rope_op_gives_hf_rotary_bit_for_bit(arch):
    # q and k as the layers pass them: views of one projection, transposed (strided)
    model = tiny_model(arch, layers=1)
    cfg = model.config
    hq, hk, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    apply_rope = type(model.model.layers[0].self_attn).__module__
    apply_rope = __import__(apply_rope, fromlist=["x"]).apply_rotary_pos_emb
    for s in (1, 5):
        qkv = torch.randn(1, s, (hq + 2 * hk) * d)
        q = qkv[..., : hq * d].view(1, s, hq, d).transpose(1, 2)
        k = qkv[..., hq * d : (hq + hk) * d].view(1, s, hk, d).transpose(1, 2)
        cos, sin = model.model.rotary_emb(qkv, torch.arange(60, 60 + s)[None])
        want, got = apply_rope(q, k, cos, sin), torch.ops.leapfx_cpu.rope(q, k, cos, sin)
        assert all(torch.equal(a, b) for a, b in zip(want, got, strict=True))


def test_rms_norm_and_rope_ops_refuse_bad_inputs_with_the_reason():
    with pytest.raises(RuntimeError, match=r"weight \[8\] expected"):
        torch.ops.leapfx_cpu.rms_norm(torch.randn(2, 8), torch.randn(7), 1e-6, 0.0)
    with pytest.raises(RuntimeError, match="float32 CPU tensors only"):
        torch.ops.leapfx_cpu.rms_norm(torch.randn(2, 8).double(), torch.randn(8), 1e-6, 0.0)
    q, k, cs = torch.randn(1, 4, 3, 8), torch.randn(1, 2, 3, 8), torch.randn(1, 3, 8)
    with pytest.raises(RuntimeError, match="even D"):
        torch.ops.leapfx_cpu.rope(q[..., :7], k[..., :7], cs[..., :7], cs[..., :7])
    with pytest.raises(RuntimeError, match="cos, sin"):
        torch.ops.leapfx_cpu.rope(q, k, cs[:, :2], cs[:, :2])
    with pytest.raises(RuntimeError, match="differ in B or S"):
        torch.ops.leapfx_cpu.rope(q, k[:, :, :2], cs, cs)


def test_rotary_table_gives_the_modules_values_and_falls_back_past_its_end():
    model = tiny_model("llama", layers=1)
    rotary = model.model.rotary_emb
    table = RotaryTable.of(rotary, 64, torch.float32, torch.device("cpu"))
    assert table is not None
    x = torch.zeros(1, 1, 1)
    ends = (torch.tensor([[0]]), torch.tensor([[63]]))
    for ids in (*ends, torch.arange(30, 35)[None], torch.arange(60, 70)[None]):  # 60..69: past it
        want, got = rotary(x, ids), table(x, ids)
        assert all(torch.equal(a, b) for a, b in zip(want, got, strict=True))
    rotary.rope_type = "dynamic"  # an inv_freq that moves with the length: no table
    assert RotaryTable.of(rotary, 64, torch.float32, torch.device("cpu")) is None

    class PerLayerType(torch.nn.Module):  # another signature: the probe fails, no table
        def forward(self, x, position_ids, layer_type):
            return rotary(x, position_ids)

    assert RotaryTable.of(PerLayerType(), 64, torch.float32, torch.device("cpu")) is None


@pytest.mark.parametrize("arch", ["llama", "gemma", "phi3"])
def test_eager_kernel_stages_use_the_norm_rope_and_rotary_ops(arch):
    # gemma: (1 + weight) norms; phi3: layers that stay unfused (its packed qkv)
    model = tiny_model(arch, layers=4)
    sm = rewrite.apply(model, "layerskip", exit_layer=2, num_speculations=3, cpu_kernels=True)
    mods = [m for st in sm._executors.values() for m in st.modules()]
    assert any(isinstance(m, KernelRMSNorm) for m in mods)
    assert any(isinstance(m, RotaryTable) for m in mods)
    layers = [m for m in mods if isinstance(m, KernelDecoderLayer)]
    assert bool(layers) == (arch != "phi3")
    for layer in layers:
        assert layer._rope.__qualname__.startswith("kernel_rope")
        assert layer._norm_in.__qualname__.startswith("_rms_norm")
    check_random_prompts(model, sm, (1, 6), 32, seed=2)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma", "qwen3"])
def test_kernel_layer_computes_the_hf_layer(arch):
    # qwen2: q/k/v biases; gemma: a GELU MLP (the unfused path); qwen3: q/k norms.
    model = tiny_model(arch, layers=2)
    layer = model.model.layers[0]
    fused, kernel = FusedDecoderLayer(layer), KernelDecoderLayer(layer)
    assert kernel._silu == (arch != "gemma")
    x = torch.randn(1, 5, model.config.hidden_size)
    pos = torch.arange(5)[None]
    rope = model.model.rotary_emb(x, pos)
    mask = torch.full((5, 5), float("-inf")).triu(1)[None, None]
    with torch.no_grad():
        want = fused(x, attention_mask=mask, position_embeddings=rope, position_ids=pos)
        got = kernel(x, attention_mask=mask, position_embeddings=rope, position_ids=pos)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_kernel_linear_keeps_the_bias():
    linear = torch.nn.Linear(12, 30)
    x = torch.randn(3, 12)
    torch.testing.assert_close(KernelLinear(linear)(x), linear(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_eager_layerskip_with_kernels_is_token_identical_to_hf_greedy(arch):
    model = tiny_model(arch, layers=4)
    sm = rewrite.apply(model, "layerskip", exit_layer=2, num_speculations=3, cpu_kernels=True)
    assert sm.cpu_kernels and sm.backend == "eager"
    check_random_prompts(model, sm, (1, 6, 13), 48, seed=1)
    assert sm.last_metrics.verify_calls > 0
    assert not sm.use_cpu_kernels(False).cpu_kernels  # back to the plain eager stages


def test_kernel_options_are_validated():
    model = tiny_model("llama", layers=2)
    with pytest.raises(ValueError, match="cpu_kernels: 'yes' is invalid"):
        rewrite.apply(model, "layerskip", exit_layer=1, cpu_kernels="yes")
    with pytest.raises(ValueError, match="cpu_kernels: 1 is invalid"):
        CompileOptions(cpu_kernels=1).validate()
    with pytest.raises(ValueError, match="--cpu-kernels: 'x' is invalid"):
        BenchConfig(cpu_kernels="x").validate()
    double = tiny_model("llama", layers=2, dtype=torch.float64)
    with pytest.raises(ValueError, match="cpu_kernels: True needs a CPU model in float32"):
        rewrite.apply(double, "layerskip", exit_layer=1, cpu_kernels=True)
    sm = rewrite.apply(double, "layerskip", exit_layer=1)
    assert not use_cpu_kernels(BenchConfig(), sm)  # auto: not for float64
    with pytest.raises(ValueError, match="--cpu-kernels: on needs a CPU model in float32"):
        use_cpu_kernels(BenchConfig(cpu_kernels=True), sm)
    with pytest.raises(ValueError, match="use_cpu_kernels: the stages run on 'inductor'"):
        sm.backend = "inductor"  # as compile() leaves it (without paying for a compile)
        sm.use_cpu_kernels()


def test_without_kernels_auto_falls_back_and_true_refuses(monkeypatch):
    model = tiny_model("llama", layers=2)
    monkeypatch.setattr(cpu, "available", lambda: False)
    assert not use_cpu_kernels(BenchConfig(), rewrite.apply(model, "autoregressive"))
    with pytest.raises(ValueError, match="did not build here"):
        rewrite.apply(model, "layerskip", exit_layer=1, cpu_kernels=True)


def test_a_compiler_without_openmp_builds_the_kernels_single_threaded(monkeypatch):
    # The kernels build with -fopenmp (ATen's parallel_for is inline OpenMP); where the
    # compiler refuses it they build without, and a machine where that happened goes straight
    # to that build next time instead of failing the OpenMP one again.
    from torch.utils import cpp_extension

    calls = []

    def load(name, sources, extra_cflags, extra_ldflags, **kw):
        openmp = "-fopenmp" in extra_cflags
        assert openmp == ("-fopenmp" in extra_ldflags)
        calls.append((name, openmp))
        if openmp:
            raise RuntimeError("g++: error: unsupported option '-fopenmp'")

    monkeypatch.setattr(cpp_extension, "load", load)
    monkeypatch.setattr(cpu, "_built", lambda name: False)
    assert cpu.load_extension("probe", cpu.SOURCE, "using torch.matmul")
    name = calls[0][0]
    assert calls == [(name, True), (f"{name}_serial", False)]
    calls.clear()
    monkeypatch.setattr(cpu, "_built", lambda name: name.endswith("_serial"))
    assert cpu.load_extension("probe", cpu.SOURCE, "using torch.matmul")
    assert calls == [(f"{name}_serial", False)]


def test_a_lock_left_by_a_killed_build_is_removed(monkeypatch, tmp_path, capsys, caplog):
    # torch waits forever on a build directory's lock file; one older than any build here was
    # left by a killed build (Ctrl-C during the first run): leapfx removes it with a warning,
    # and says what it waits on when the lock is young (another process may be building).
    import os
    import time

    from torch.utils import cpp_extension

    monkeypatch.setattr(cpp_extension, "_get_build_directory", lambda name, verbose: tmp_path)
    lock = tmp_path / "lock"
    lock.write_text("")
    cpu._clear_stale_lock("probe")
    assert lock.exists()
    assert "waiting for another process's build of probe" in capsys.readouterr().err
    old = time.time() - cpu.STALE_LOCK_S - 60
    os.utime(lock, (old, old))
    with caplog.at_level("WARNING", logger=cpu.__name__):
        cpu._clear_stale_lock("probe")
    assert not lock.exists() and "left by a killed build" in caplog.text
    cpu._clear_stale_lock("probe")  # no lock: nothing to say
    assert capsys.readouterr().err == ""
