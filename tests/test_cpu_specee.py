"""``leapfx_cpu::exit_check`` (leapfx/kernels/cpu_specee.cpp): SpecEE's exit check in one call.

The torch path (``LayerExit``) is the reference: the kernel must give its numbers (to float
rounding) for every architecture's final norm, and SpecEE decoding with the kernel checks must
make the same exits and emit the same tokens.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from leapfx import rewrite
from leapfx.kernels import cpu_specee
from leapfx.modules.specee import KernelLayerExit, LayerExit
from leapfx.passes.predictor import predictors_of
from tests.conftest import examples, tiny_model
from tests.greedy_check import check_random_prompts


@pytest.fixture(scope="module", autouse=True)
def built():
    assert cpu_specee.available(), "leapfx_cpu::exit_check did not build (see the warning)"


def _randomise(model: torch.nn.Module, seed: int) -> None:
    """Norm weights away from their init (ones / zeros), so the weight and offset matter."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        w = model.model.norm.weight
        w.copy_(torch.rand(w.shape, generator=g) + 0.5)


def _checks(model, seed: int = 0) -> tuple[LayerExit, KernelLayerExit]:
    sm = rewrite.apply(model, "specee", drafter="exit_head", exit_layer=1)
    ref = predictors_of(sm.graph_module).exits[0]
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in ref.mlp.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return ref, KernelLayerExit(ref)


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen3", "phi3", "gemma"])
def test_kernel_check_computes_the_torch_check(arch):
    model = tiny_model(arch, layers=2)
    _randomise(model, 1)
    ref, kernel = _checks(model)
    assert kernel._norm is not None, "the kernel must apply to this architecture's norm"
    assert kernel._norm[2] == (1.0 if arch == "gemma" else 0.0)  # Gemma scales by 1 + w
    g = torch.Generator().manual_seed(2)
    h = torch.randn(2, 3, model.config.hidden_size, generator=g) * 3
    cands = torch.tensor([5, 1, 8, 3])
    p_prev = torch.softmax(torch.randn(2, 4, generator=g), -1)
    with torch.inference_mode():
        for prev in (None, p_prev):
            want_prob, want_p = ref(h, cands, prev)
            got_prob, got_p = kernel(h, cands, prev)
            torch.testing.assert_close(got_p, want_p, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(got_prob, want_prob, rtol=1e-5, atol=1e-6)
        none, p_only = kernel(h, cands, p_prev, with_mlp=False)
        assert none is None
        torch.testing.assert_close(p_only, ref(h, cands, p_prev, with_mlp=False)[1])
        # The runtime's check: the probability as a float, and the logits where it fires.
        row, want_prob = h[:1], float(ref(h[:1], cands, p_prev[:1])[0])
        prob, p, logits = kernel.check(row, cands, p_prev[:1], threshold=want_prob + 1e-3)
        assert prob == pytest.approx(want_prob, rel=1e-5) and logits is None
        prob, p, logits = kernel.check(row, cands, p_prev[:1], threshold=want_prob - 1e-3)
        head = model.lm_head.weight
        torch.testing.assert_close(logits, model.model.norm(row[:, -1]) @ head.T)
        assert ref.check(row, cands, p_prev[:1], threshold=0.0)[2] is None  # the torch path


@settings(max_examples=examples(40, 160), deadline=None)
@given(
    hidden=st.integers(1, 70),
    vocab=st.integers(4, 40),
    k=st.integers(1, 6),
    width=st.integers(1, 40),
    rows=st.integers(1, 3),
    offset=st.sampled_from([0.0, 1.0]),
    prev=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_exit_check_op_matches_torch(hidden, vocab, k, width, rows, offset, prev, seed):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(rows, hidden, generator=g)
    norm_w = torch.rand(hidden, generator=g) + 0.5
    head = torch.randn(vocab, hidden, generator=g)
    cands = torch.randint(0, vocab, (k,), generator=g)
    p_prev = torch.softmax(torch.randn(rows, k, generator=g), -1) if prev else None
    w1, b1 = torch.randn(width, 3 * k, generator=g), torch.randn(width, generator=g)
    w2, b2 = torch.randn(1, width, generator=g), torch.randn(1, generator=g)
    eps = 1e-6
    normed = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * (offset + norm_w)
    z = normed @ head[cands].T
    p = torch.softmax(z, -1)
    x = torch.cat([z, p, p - p_prev if prev else p], -1)
    want = torch.sigmoid(torch.relu(x @ w1.T + b1) @ w2.T + b2)[:, 0]
    mlp = cpu_specee.pack_mlp(w1, b1, w2, b2)
    norm = (norm_w, eps, offset)
    got, got_p, logits = cpu_specee.exit_check(h, norm, head, cands, p_prev, mlp)
    torch.testing.assert_close(got_p, p, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)
    assert logits is None  # threshold 2.0 (the default): never fires
    threshold = float(want.min()) - 1e-3  # every row fires: the full logits come back
    *_, logits = cpu_specee.exit_check(h, norm, head, cands, p_prev, mlp, threshold=threshold)
    torch.testing.assert_close(logits, normed @ head.T, rtol=1e-5, atol=1e-5)


def test_packed_mlp_follows_in_place_training():
    ref, kernel = _checks(tiny_model("llama", layers=2))
    h, cands = torch.randn(1, 1, 32), torch.tensor([0, 1, 2, 3])
    before = kernel(h, cands, None)[0]
    with torch.no_grad():
        ref.mlp[2].bias.add_(1.0)  # as an optimiser step does
    with torch.inference_mode():
        torch.testing.assert_close(kernel(h, cands, None)[0], ref(h, cands, None)[0])
    assert not torch.equal(before, kernel(h, cands, None)[0])


def test_torch_path_where_the_kernel_does_not_apply():
    model = tiny_model("llama", layers=2)
    ref, _ = _checks(model)
    norm, head = ref._host
    layer_norm = torch.nn.LayerNorm(32)  # not an RMSNorm: the probe does not match
    assert cpu_specee.rms_offset(layer_norm, head.weight) is None
    ref._host = (layer_norm, head)
    kernel = KernelLayerExit(ref)
    assert kernel._norm is None
    h, cands = torch.randn(1, 2, 32), torch.tensor([3, 1, 2, 0])
    torch.testing.assert_close(kernel(h, cands, None)[0], ref(h, cands, None)[0])
    h.requires_grad_(True)  # gradients wanted: the torch path (the op has no backward)
    prob, _ = _checks(model)[1](h, cands, None)
    assert prob.requires_grad


def test_bad_inputs_are_refused_with_the_reason():
    h, norm = torch.randn(1, 8), (torch.ones(8), 1e-6, 0.0)
    head = torch.randn(10, 8)
    mlp = cpu_specee.pack_mlp(torch.randn(4, 12), torch.randn(4), torch.randn(1, 4), torch.randn(1))
    with pytest.raises(RuntimeError, match="candidate 10 is outside"):
        cpu_specee.exit_check(h, norm, head, torch.tensor([1, 2, 3, 10]), None, mlp)
    with pytest.raises(RuntimeError, match="k=0 speculative tokens"):
        cpu_specee.exit_check(h, norm, head, torch.tensor([], dtype=torch.long), None, mlp)
    with pytest.raises(RuntimeError, match="float32 CPU tensors only"):
        cpu_specee.exit_check(h.double(), norm, head, torch.tensor([1, 2, 3, 4]), None, mlp)
    with pytest.raises(RuntimeError, match="packed"):
        cpu_specee.exit_check(h, norm, head, torch.tensor([1, 2, 3]), None, mlp)


@pytest.mark.parametrize("drafter", ["exit_head", "eagle"])
def test_specee_with_kernel_checks_makes_the_same_exits(drafter):
    # Random predictors (spread probabilities: an untrained MLP sits at 0.5, the threshold,
    # where float rounding alone decides) exit often; the kernel checks must not change any
    # decision: same tokens, same layers as the torch checks.
    model = tiny_model("llama", layers=4)
    runs = []
    for kernels in (False, True):
        sm = rewrite.apply(model, "specee", drafter=drafter, exit_layer=2)
        g = torch.Generator().manual_seed(5)
        with torch.no_grad():
            for p in predictors_of(sm.graph_module).parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
        sm.use_cpu_kernels()
        stages = sm._executors.values()
        found = [m for s in stages for m in s.modules() if isinstance(m, KernelLayerExit)]
        assert found, "use_cpu_kernels() puts the kernel checks in the check stages"
        if not kernels:
            for m in found:
                m._norm = None  # the torch path, as without the kernels
        g = torch.Generator().manual_seed(3)
        outs = [
            sm.generate(torch.randint(1, 128, (1, n), generator=g), max_new_tokens=24)
            for n in (3, 9)
        ]
        runs.append((outs, sm.last_metrics.avg_layers))
    assert all(torch.equal(a, b) for a, b in zip(runs[0][0], runs[1][0], strict=True))
    assert runs[0][1] == runs[1][1] < 4  # it exited, at the same layers


def test_verified_specee_with_kernel_checks_is_greedy_identical():
    model = tiny_model("llama", layers=4)
    sm = rewrite.apply(model, "specee", drafter="exit_head", exit_layer=2, verify=True)
    sm.use_cpu_kernels()
    check_random_prompts(model, sm, (2, 11), 32, seed=4)
    assert sm.last_metrics.verify_calls > 0
