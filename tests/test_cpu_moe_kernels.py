"""leapfx_cpu::moe_experts and the MoE layers' kernel modules (KernelExperts, KernelAttention).

The op computes an HF ``<X>Experts`` module's forward from its fused weights (or from the
offload runtime's slot pools), one token's row at a time. Like the dense kernels it is built on
first use; CI has a compiler, so a failed build fails these tests.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from leapfx import rewrite
from leapfx.kernels import cpu
from leapfx.modules.fused import FusedAttention
from leapfx.modules.kernel_layers import KernelAttention, KernelExperts, experts_kernel_covers
from leapfx.offload import OffloadOptions
from leapfx.passes.capture import nodes_by_role
from tests.conftest import MOE_ARCHS, examples, tiny_moe_model
from tests.greedy_check import check_random_prompts


@pytest.fixture(scope="module", autouse=True)
def built():
    assert cpu.available(), "the leapfx_cpu kernels did not build (see the logged warning)"


def _experts(model, layer: int = 0):
    return model.model.layers[layer].mlp.experts


def _routing(tokens: int, experts: int, k: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    index = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(tokens)])
    return index, torch.rand(tokens, k, generator=g)


@settings(max_examples=examples(30, 120), deadline=None)
@given(arch=st.sampled_from(MOE_ARCHS), tokens=st.integers(1, 20), experts=st.integers(2, 8),
       k=st.integers(1, 3), seed=st.integers(0, 999))  # fmt: skip
def test_moe_experts_op_computes_the_hf_experts_module(arch, tokens, experts, k, seed):
    k = min(k, experts)
    model = tiny_moe_model(arch, layers=1, experts=experts, top_k=k, seed=seed)
    module = _experts(model)
    assert experts_kernel_covers(module)
    hidden = torch.randn(tokens, model.config.hidden_size)
    index, weights = _routing(tokens, experts, k, seed)
    with torch.no_grad():
        want = module(hidden, index, weights)
        got = torch.ops.leapfx_cpu.moe_experts(
            hidden, index, weights, module.gate_up_proj, module.down_proj
        )
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_rows_are_independent_and_out_of_range_experts_add_nothing():
    module = _experts(tiny_moe_model("olmoe", layers=1, experts=6, intermediate=32, seed=3))
    gate_up, down = module.gate_up_proj.detach(), module.down_proj.detach()
    hidden = torch.randn(7, gate_up.shape[2])
    index, weights = _routing(7, 6, 2, seed=5)
    op = torch.ops.leapfx_cpu.moe_experts
    whole = op(hidden, index, weights, gate_up, down)
    rows = torch.cat([op(hidden[t : t + 1], index[t : t + 1], weights[t : t + 1], gate_up, down)
                      for t in range(7)])  # fmt: skip
    assert torch.equal(whole, rows)  # a token's row does not depend on the others
    # An offload wave marks the experts it does not hold with an index past the pool (or < 0).
    first = op(hidden, index[:, :1], weights[:, :1], gate_up, down)
    for sentinel in (6, 100, -1):
        masked = torch.stack([index[:, 0], torch.full((7,), sentinel)], dim=1)
        assert torch.equal(op(hidden, masked, weights, gate_up, down), first)


def test_moe_experts_refuses_bad_inputs_with_the_reason():
    op = torch.ops.leapfx_cpu.moe_experts
    gate_up, down = torch.randn(4, 16, 8), torch.randn(4, 8, 8)
    x, index, w = torch.randn(2, 8), torch.zeros(2, 2, dtype=torch.long), torch.ones(2, 2)
    with pytest.raises(RuntimeError, match="float32 CPU tensors expected"):
        op(x.double(), index, w, gate_up, down)
    with pytest.raises(RuntimeError, match="top_k_index must be int64"):
        op(x, index.int(), w, gate_up, down)
    with pytest.raises(RuntimeError, match=r"hidden \[T, H\]"):
        op(x[None], index, w, gate_up, down)
    with pytest.raises(RuntimeError, match=r"gate_up \[S, 2I, H=8\]"):
        op(x, index, w, torch.randn(4, 16, 5), down)
    with pytest.raises(RuntimeError, match=r"down \[S=4, H=8, I=8\]"):
        op(x, index, w, gate_up, torch.randn(4, 8, 7))


def test_experts_kernel_covers_only_what_it_computes():
    model = tiny_moe_model("mixtral", layers=1)
    module = _experts(model)
    assert experts_kernel_covers(module)
    module.act_fn = torch.nn.GELU()  # another activation: HF's code runs
    assert not experts_kernel_covers(module)
    assert not experts_kernel_covers(_experts(tiny_moe_model("olmoe", layers=1)).double())
    assert not experts_kernel_covers(torch.nn.Linear(4, 4))


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_kernel_attention_computes_the_fused_attention(arch):
    # olmoe: full-width q/k norms and clip_qkv; qwen3_moe: per-head q/k norms; mixtral: a
    # sliding window (attention through SDPA behind the mask, not the kernel).
    model = tiny_moe_model(arch, layers=1, seed=1, sliding_window=3 if arch == "mixtral" else None)
    if arch == "olmoe":
        model.config.clip_qkv = 0.05
    attn = model.model.layers[0].self_attn
    fused = FusedAttention(attn)
    kernel = KernelAttention(fused)
    if arch in ("olmoe", "mixtral"):  # (qwen configs carry a window size even when unused)
        assert kernel._kernel_attention == (arch == "olmoe")
    x = torch.randn(1, 5, model.config.hidden_size)
    pos = torch.arange(5)[None]
    rope = model.model.rotary_emb(x, pos)
    mask = torch.full((5, 5), float("-inf")).triu(1)
    if arch == "mixtral":
        mask = mask.masked_fill(torch.ones(5, 5, dtype=torch.bool).tril(-3), float("-inf"))
    kw = dict(attention_mask=mask[None, None], position_embeddings=rope, position_ids=pos)
    with torch.no_grad():
        want, _ = fused(x, **kw)
        got, _ = kernel(x, **kw)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch", MOE_ARCHS)
@pytest.mark.parametrize("recipe", ["autoregressive", "layerskip"])
def test_moe_kernel_stages_decode_like_hf_greedy(arch, recipe):
    model = tiny_moe_model(arch, layers=3, experts=6, top_k=2, seed=7,
                           dense_layers=(1,) if arch == "qwen2_moe" else ())  # fmt: skip
    opts = {"exit_layer": 1, "num_speculations": 3} if recipe == "layerskip" else {}
    sm = rewrite.apply(model, recipe, cpu_kernels=True, **opts)
    assert sm.cpu_kernels
    mods = [m for stage in sm._executors.values() for m in stage.modules()]
    assert any(isinstance(m, KernelExperts) for m in mods)
    assert any(isinstance(m, KernelAttention) for m in mods)
    check_random_prompts(model, sm, (1, 7), 24, seed=3)


def test_offloaded_experts_run_the_op_over_the_slots_with_kernels():
    model = tiny_moe_model("olmoe", layers=3, experts=6, intermediate=32, seed=2)
    prompt = torch.tensor([[4, 8, 15, 16, 23, 42]])
    resident = rewrite.apply(model, "autoregressive", cpu_kernels=True)
    want = resident.generate(prompt, max_new_tokens=20)
    calls = []
    sm = rewrite.apply(model, "autoregressive", cpu_kernels=True,
                       offload=OffloadOptions(slots=2, poison=True))  # fmt: skip
    try:
        assert sm.offload.kernels
        real = sm.offload._run

        def spy(layer, *args):
            calls.append(layer)
            return real(layer, *args)

        sm.offload._run = spy
        assert torch.equal(sm.generate(prompt, max_new_tokens=20), want)
        assert calls and not sm.use_cpu_kernels(False).offload.kernels
        # back on HF's code over the same slots: the same tokens up to rounding
        check_random_prompts(model, sm, (6,), 12, seed=1)
    finally:
        sm.offload.close()
    ops = [n for n in nodes_by_role(sm.graph_module, "experts")]
    assert ops and all(n.target.startswith("leapfx_offload.experts_") for n in ops)
