"""Kernels: the custom ops against the pure torch rules, their tracing, and Triton vs reference.

Three layers, all over hypothesis-generated shapes (B 1..3, d 0..6, V 2..300):

1. The ops' torch path equals :mod:`leapfx.kernels.reference` (and, for the subset logits, a full
   ``hidden @ weight.T`` softmax), plus hand-computed golden cases and input errors.
2. Tracing: ``torch.library.opcheck``, ``torch.compile(fullgraph=True, dynamic=True)`` keeping each
   op as one node across shapes, ``torch.export``.
3. Triton: each kernel compiles for an sm_90 target (no GPU needed: catches what the interpreter
   forgives, like loop-carried dtype changes); the Triton functions equal the reference under
   ``TRITON_INTERPRET=1``; the same on CUDA without the interpreter (``gpu``, skipped on CPU).

Triton fixes interpreter mode when it is first imported (see :mod:`leapfx.kernels._triton`), and
by the time this file runs other modules have usually imported it compiled. So the ``test_interp_*``
tests run in this process only when it was started with ``TRITON_INTERPRET=1``; otherwise
:func:`test_triton_interpreter_in_subprocess` runs them in a child pytest that sets it.

Speculative sampling's ``next_token`` may differ between implementations only where the uniform
lands within rounding of a CDF boundary (sums in different orders); :func:`assert_same_or_cdf_tie`
checks that every such difference is one, in float64, and never a token without mass.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import leapfx.kernels as K
from leapfx.kernels import _triton, greedy, speculative, subset
from leapfx.kernels import reference as verify
from tests.conftest import examples

INTERP_REASON = (
    "Triton runs compiled in this process (TRITON_INTERPRET=1 was not set when triton was first "
    "imported); test_triton_interpreter_in_subprocess runs these under the interpreter"
)
needs_triton = pytest.mark.skipif(
    not K.HAS_TRITON,
    reason="triton is not installed (pip install -e '.[triton]' in leapfx's checkout)",
)
needs_interp = pytest.mark.skipif(
    not (K.HAS_TRITON and K.INTERPRETING),
    reason=INTERP_REASON if K.HAS_TRITON else "triton is not installed",
)

batch = st.integers(1, 3)
n_draft = st.integers(0, 6)
vocab = st.integers(2, 300)
seeds = st.integers(0, 2**31 - 1)


# ---------------------------------------------------------------- inputs


def greedy_inputs(seed: int, B: int, d: int, V: int, dtype: torch.dtype, ties: bool):
    """Logits (few distinct values when ``ties``: argmax ties are common) and drafts that match
    the argmax except at random positions, so every ``n_accepted`` in 0..d occurs."""
    g = torch.Generator().manual_seed(seed)
    if ties:
        logits = torch.randint(0, 4, (B, d + 1, V), generator=g).to(dtype)
    else:
        logits = torch.randn(B, d + 1, V, generator=g).to(dtype)
    draft = logits.argmax(-1)[:, :d]
    wrong = torch.rand(B, d, generator=g) < 0.3
    draft = torch.where(wrong, torch.randint(0, V, (B, d), generator=g), draft)
    return draft, logits


def _dists(g: torch.Generator, shape: tuple[int, ...]) -> torch.Tensor:
    """Sparse random distributions in float64 (zero-mass tokens occur; each row has mass)."""
    w = torch.rand(*shape, generator=g, dtype=torch.float64) ** 4
    w = torch.where(w < 0.05, torch.zeros_like(w), w)
    anchor = torch.randint(0, shape[-1], (*shape[:-1], 1), generator=g)
    w = w.scatter(-1, anchor, 0.5)
    return w / w.sum(-1, keepdim=True)


def speculative_inputs(seed: int, B: int, d: int, V: int, dtype: torch.dtype):
    """Drafts mostly sampled from q (sometimes arbitrary, so q(x) = 0 occurs), rows with p == q
    (all-zero residual), uniforms exactly at the accept probability (strict test), 0 and 1."""
    g = torch.Generator().manual_seed(seed)
    q = _dists(g, (B, d, V))
    p = _dists(g, (B, d + 1, V))
    same = (torch.rand(B, d, 1, generator=g) < 0.25).expand(B, d, V)
    p[:, :d] = torch.where(same, q, p[:, :d])
    q, p = q.to(dtype), p.to(dtype)
    if d:
        x = torch.multinomial(q.reshape(-1, V).double(), 1, generator=g).reshape(B, d)
    else:
        x = torch.zeros(B, 0, dtype=torch.long)
    arbitrary = torch.rand(B, d, generator=g) < 0.15
    x = torch.where(arbitrary, torch.randint(0, V, (B, d), generator=g), x)
    accept_prob, _ = verify.acceptance(x, q, p)
    u_accept = torch.rand(B, d, generator=g, dtype=dtype)
    pick = torch.rand(B, d, generator=g)
    u_accept = torch.where(pick < 0.15, accept_prob, u_accept)
    u_accept = torch.where(pick > 0.95, torch.ones_like(u_accept), u_accept)
    u_sample = torch.rand(B, generator=g, dtype=dtype)
    edge = torch.tensor([0.0, 1.0, 1 - 2**-24], dtype=dtype)[torch.randint(0, 3, (B,), generator=g)]
    u_sample = torch.where(torch.rand(B, generator=g) < 0.2, edge, u_sample)
    return x, q, p, u_accept, u_sample


def subset_inputs(seed: int, B: int, H: int, V: int, Kn: int, dtype: torch.dtype):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, H, generator=g).to(dtype)
    weight = torch.randn(V, H, generator=g).to(dtype)
    indices = torch.randint(0, V, (Kn,), generator=g)  # duplicates allowed
    return hidden, weight, indices


def to(device: str, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return tuple(t.to(device) for t in tensors)


# ---------------------------------------------------------------- checks shared by all paths


def assert_same_or_cdf_tie(args, ref, got) -> int:
    """``n_accepted`` equal; each differing ``next_token`` a float tie of the emitted CDF.

    Returns the number of ties (the caller may report them; they are not failures).
    """
    x, q, p, _, u_sample = (t.cpu() for t in args)
    n_ref, tok_ref = (t.cpu() for t in ref)
    n_got, tok_got = (t.cpu() for t in got)
    assert torch.equal(n_got, n_ref), (n_got, n_ref)
    d = x.shape[1]
    _, residual = verify.acceptance(x, q.double(), p.double())
    emit = torch.cat([residual, p.double()[:, d:]], dim=1)  # [B, d+1, V]
    ties = 0
    for b in torch.nonzero(tok_got != tok_ref).flatten().tolist():
        dist = emit[b, n_ref[b]]
        a, c = sorted((int(tok_ref[b]), int(tok_got[b])))
        assert dist[int(tok_got[b])] > 0, f"row {b}: token {int(tok_got[b])} has no mass"
        cdf = dist.cumsum(0)
        threshold = float(u_sample[b].clamp(min=0)) * float(cdf[-1])
        tol = 1e-5 if p.dtype == torch.float32 else 1e-12
        assert (
            abs(float(cdf[a]) - threshold) <= tol and abs(float(cdf[c - 1]) - threshold) <= tol
        ), (
            f"row {b}: next_token {int(tok_got[b])} vs reference {int(tok_ref[b])} is not a tie: "
            f"u * total = {threshold}, cdf[{a}] = {float(cdf[a])}, "
            f"cdf[{c - 1}] = {float(cdf[c - 1])}"
        )
        ties += 1
    return ties


def check_greedy(fn, device, seed, B, d, V, dtype, ties):
    draft, logits = greedy_inputs(seed, B, d, V, dtype, ties)
    ref = verify.greedy_accept(draft, logits)
    got = fn(*to(device, draft, logits))
    assert all(t.dtype == torch.long and t.device.type == device for t in got)
    assert torch.equal(got[0].cpu(), ref[0]) and torch.equal(got[1].cpu(), ref[1]), (got, ref)


def check_speculative(fn, device, seed, B, d, V, dtype, exact):
    args = speculative_inputs(seed, B, d, V, dtype)
    ref = verify.speculative_accept(*args)
    got = fn(*to(device, *args))
    assert all(t.dtype == torch.long and t.device.type == device for t in got)
    if exact:
        assert torch.equal(got[0].cpu(), ref[0]) and torch.equal(got[1].cpu(), ref[1])
    else:
        assert_same_or_cdf_tie(args, ref, got)


def check_subset(fn, device, seed, B, H, V, Kn, dtype, atol):
    hidden, weight, indices = subset_inputs(seed, B, H, V, Kn, dtype)
    # Independent formulation: all V logits, then pick the columns.
    full = hidden.double() @ weight.double().T  # [B, V]
    want_logits = full[:, indices]
    want_probs = torch.softmax(want_logits, dim=-1)
    logits, probs = fn(*to(device, hidden, weight, indices))
    out_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    assert logits.dtype == probs.dtype == out_dtype and logits.shape == (B, Kn)
    torch.testing.assert_close(logits.cpu().double(), want_logits, rtol=1e-5, atol=atol)
    torch.testing.assert_close(probs.cpu().double(), want_probs, rtol=1e-5, atol=atol)


GREEDY_CASES = [  # (draft, target argmax, n_accepted, next_token), as in test_verify
    ([3, 1, 4], [3, 1, 4, 7], 3, 7),  # all accepted -> bonus
    ([2, 1, 4], [3, 1, 4, 7], 0, 3),  # first rejected -> correction
    ([3, 5, 4], [3, 1, 4, 7], 1, 1),  # a later match does not count
    ([], [6], 0, 6),  # d = 0
]


def check_greedy_golden(fn, device):
    for draft, target, n, nxt in GREEDY_CASES:
        logits = torch.full((1, len(target), 8), -1.0)
        logits[0, torch.arange(len(target)), target] = 2.0
        logits[0, :, 7] = torch.where(torch.tensor(target) == 7, 2.0, 2.0 - 1e-6)  # near-tie
        draft_t = torch.tensor([draft], dtype=torch.long).reshape(1, len(draft))
        got = fn(*to(device, draft_t, logits))
        assert [got[0].item(), got[1].item()] == [n, nxt], (draft, target)
    # Exact ties go to the lowest index; NaN wins like in torch.argmax.
    logits = torch.tensor([[[0.0, 5.0, 5.0, 1.0], [float("nan"), 1.0, float("nan"), 9.0]]])
    got = fn(*to(device, torch.tensor([[1]]), logits))
    assert [got[0].item(), got[1].item()] == [1, 0]


def check_speculative_golden(fn, device):
    q = torch.tensor([[[0.5, 0.5]]])
    p = torch.tensor([[[0.25, 0.75], [1.0, 0.0]]])
    cases = [  # (u_accept, u_sample, n_accepted, next_token)
        (0.4, 0.9, 1, 0),  # 0.4 < p/q = 0.5: accepted; bonus from p_2 = [1, 0]
        (0.6, 0.0, 0, 1),  # rejected: residual max(p - q, 0) = [0, 0.25] -> token 1
        (0.5, 0.0, 0, 1),  # u == accept prob rejects (strict <)
    ]
    for u_a, u_s, n, nxt in cases:
        args = (torch.tensor([[0]]), q, p, torch.tensor([[u_a]]), torch.tensor([u_s]))
        got = fn(*to(device, *args))
        assert [got[0].item(), got[1].item()] == [n, nxt], (u_a, u_s)
    # p == q and u_accept = 1: rejected with an all-zero residual, so sample p_1 itself.
    args = (torch.tensor([[1]]), q, torch.tensor([[[0.5, 0.5], [0.0, 1.0]]]))
    got = fn(*to(device, *args, torch.tensor([[1.0]]), torch.tensor([0.75])))
    assert [got[0].item(), got[1].item()] == [0, 1]
    # u_sample >= 1 and zero-mass tails: the last token with mass, never past it.
    p = torch.tensor([[[0.0, 0.6, 0.4, 0.0, 0.0]]])
    x0 = torch.zeros(1, 0, dtype=torch.long)
    got = fn(*to(device, x0, torch.zeros(1, 0, 5), p, torch.zeros(1, 0), torch.tensor([1.0])))
    assert [got[0].item(), got[1].item()] == [0, 2]


# ---------------------------------------------------------------- 1. the torch path


@given(seed=seeds, B=batch, d=n_draft, V=vocab, ties=st.booleans(),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float64]))  # fmt: skip
def test_greedy_op_matches_verify(seed, B, d, V, ties, dtype):
    check_greedy(K.greedy_accept, "cpu", seed, B, d, V, dtype, ties)


@given(seed=seeds, B=batch, d=n_draft, V=vocab,
       dtype=st.sampled_from([torch.float32, torch.float64]))  # fmt: skip
def test_speculative_op_matches_verify(seed, B, d, V, dtype):
    exact = _triton.implementation(torch.zeros(1)) == "torch"
    check_speculative(K.speculative_accept, "cpu", seed, B, d, V, dtype, exact)


@given(seed=seeds, B=batch, H=st.integers(1, 48), V=vocab, Kn=st.integers(1, 300),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float64]))  # fmt: skip
def test_subset_op_matches_full_softmax(seed, B, H, V, Kn, dtype):
    check_subset(K.subset_logits, "cpu", seed, B, H, V, Kn, dtype, atol=1e-4)


def test_golden_cases_through_the_ops():
    check_greedy_golden(K.greedy_accept, "cpu")
    check_speculative_golden(K.speculative_accept, "cpu")


def test_dispatch_rule(monkeypatch):
    """On CPU the op runs Triton iff Triton is interpreting; the other path is never called."""
    calls = []
    for module, name in [(greedy, "greedy_accept"), (speculative, "speculative_accept"),
                         (subset, "subset_logits")]:  # fmt: skip
        for impl in ("reference", "triton"):
            real = getattr(module, f"{name}_{impl}")
            spy = lambda *a, _real=real, _tag=(name, impl): calls.append(_tag) or _real(*a)  # noqa: E731
            monkeypatch.setattr(module, f"{name}_{impl}", spy)
    expected = "triton" if (K.HAS_TRITON and K.INTERPRETING) else "reference"
    assert K.implementation(torch.zeros(1)) == ("triton" if expected == "triton" else "torch")
    K.greedy_accept(*greedy_inputs(0, 2, 3, 10, torch.float32, ties=False))
    K.speculative_accept(*speculative_inputs(0, 2, 3, 10, torch.float32))
    K.subset_logits(*subset_inputs(0, 2, 4, 10, 3, torch.float32))
    assert calls == [
        (n, expected) for n in ("greedy_accept", "speculative_accept", "subset_logits")
    ]


def test_subset_gradients():
    """Backward (torch ops) against autograd through the reference, and gradcheck in float64."""
    hidden, weight, indices = subset_inputs(1, 2, 5, 9, 4, torch.float64)
    indices = torch.tensor([3, 7, 3, 0])  # a duplicate row accumulates twice
    hidden.requires_grad_(True)
    weight.requires_grad_(True)
    assert torch.autograd.gradcheck(lambda h, w: K.subset_logits(h, w, indices), (hidden, weight))
    g1, g2 = torch.randn(2, 4, dtype=torch.float64), torch.randn(2, 4, dtype=torch.float64)
    logits, probs = K.subset_logits(hidden, weight, indices)
    want_logits, want_probs = subset.subset_logits_reference(hidden, weight, indices)
    got = torch.autograd.grad((logits * g1).sum() + (probs * g2).sum(), (hidden, weight))
    want = torch.autograd.grad((want_logits * g1).sum() + (want_probs * g2).sum(), (hidden, weight))
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b)


def test_input_errors():
    draft, logits = greedy_inputs(0, 2, 3, 10, torch.float32, ties=False)
    with pytest.raises(ValueError, match=r"target_logits must be \[B, d\+1, V\]"):
        K.greedy_accept(draft, logits[:, :3])
    with pytest.raises(ValueError, match="integer tensor"):
        K.greedy_accept(draft.float(), logits)
    x, q, p, ua, us = speculative_inputs(0, 2, 3, 10, torch.float32)
    with pytest.raises(ValueError, match="float32, torch.float64"):
        K.speculative_accept(x, q.half(), p.half(), ua, us)
    with pytest.raises(ValueError, match="one dtype"):
        K.speculative_accept(x, q.double(), p, ua, us)
    with pytest.raises(ValueError, match=r"draft_probs must be \[B, d, V\]"):
        K.speculative_accept(x, q[:, :2], p, ua, us)
    with pytest.raises(ValueError, match=r"u_sample \[B\]"):
        K.speculative_accept(x, q, p, ua, us[:1])
    hidden, weight, indices = subset_inputs(0, 2, 4, 10, 3, torch.float32)
    with pytest.raises(ValueError, match="share H"):
        K.subset_logits(hidden, weight[:, :3], indices)
    with pytest.raises(ValueError, match="indices must be an integer"):
        K.subset_logits(hidden, weight, indices.float())


# ---------------------------------------------------------------- 2. tracing


OPS = {
    "greedy_accept": (
        torch.ops.leapfx.greedy_accept.default,
        lambda B, d, V: greedy_inputs(0, B, d, V, torch.float32, ties=True),
    ),
    "speculative_accept": (
        torch.ops.leapfx.speculative_accept.default,
        lambda B, d, V: speculative_inputs(0, B, d, V, torch.float32),
    ),
    "subset_logits": (
        torch.ops.leapfx.subset_logits.default,
        lambda B, d, V: subset_inputs(0, B, 8, V, d + 2, torch.float32),
    ),
}


@pytest.mark.parametrize("name", OPS)
@pytest.mark.parametrize("shape", [(2, 3, 17), (1, 0, 5)])
def test_opcheck(name, shape):
    op, make = OPS[name]
    args = make(*shape)
    if name == "subset_logits":
        args = (args[0].requires_grad_(True), args[1].requires_grad_(True), args[2])
    torch.library.opcheck(op, args)


@pytest.mark.parametrize("name", OPS)
def test_compile_fullgraph_keeps_one_op_node_across_shapes(name):
    from torch._dynamo.backends.common import aot_autograd

    op, make = OPS[name]
    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return gm

    def step(*args):  # the op inside some surrounding tensor code, like a decode step
        a, b = op(*args)
        return a + 1, b * 2

    compiled = torch.compile(step, fullgraph=True, dynamic=True,
                             backend=aot_autograd(fw_compiler=record))  # fmt: skip
    torch._dynamo.reset()
    for shape in [(2, 3, 17), (3, 5, 40)]:
        args = make(*shape)
        want = step(*args)
        got = compiled(*args)
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert len(graphs) == 1, "the fake implementation should trace symbolic shapes (no recompile)"
    targets = [n.target for n in graphs[0].graph.nodes if n.op == "call_function"]
    assert targets.count(op) == 1, targets
    torch._dynamo.reset()


def test_export_keeps_ops():
    class Step(torch.nn.Module):
        def forward(self, draft, logits, hidden, weight, indices):
            n, nxt = torch.ops.leapfx.greedy_accept(draft, logits)
            logits_k, probs_k = torch.ops.leapfx.subset_logits(hidden, weight, indices)
            return n, nxt, probs_k

    args = (*greedy_inputs(0, 2, 3, 17, torch.float32, ties=True),
            *subset_inputs(0, 2, 8, 17, 5, torch.float32))  # fmt: skip
    ep = torch.export.export(Step(), args)
    targets = [n.target for n in ep.graph.nodes if n.op == "call_function"]
    assert torch.ops.leapfx.greedy_accept.default in targets
    assert torch.ops.leapfx.subset_logits.default in targets
    for a, b in zip(ep.module()(*args), Step()(*args), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


# ---------------------------------------------------------------- 3. Triton


def _kernel_signatures():
    """(kernel, pointer types by argument name (the rest are i32), constexprs) to compile."""
    tl = _triton.tl
    return [
        (greedy._row_argmax_kernel, {"logits": "*bf16", "tokens": "*i64"},
         {"BLOCK_V": 2048, "ACC": tl.float32}),
        (greedy._row_argmax_kernel, {"logits": "*fp64", "tokens": "*i64"},
         {"BLOCK_V": 256, "ACC": tl.float64}),
        (greedy._prefix_match_kernel,
         {"draft": "*i32", "tokens": "*i64", "n_accepted": "*i64", "next_token": "*i64"},
         {"BLOCK_D": 8}),
        (speculative._speculative_accept_kernel,
         {"draft": "*i64", "q": "*fp32", "p": "*fp32", "u_accept": "*fp32", "u_sample": "*fp32",
          "n_accepted": "*i64", "next_token": "*i64"},
         {"BLOCK_D": 8, "BLOCK_V": 1024, "DTYPE": tl.float32}),
        (speculative._speculative_accept_kernel,
         {"draft": "*i64", "q": "*fp64", "p": "*fp64", "u_accept": "*fp64", "u_sample": "*fp64",
          "n_accepted": "*i64", "next_token": "*i64"},
         {"BLOCK_D": 1, "BLOCK_V": 1024, "DTYPE": tl.float64}),
        (subset._subset_logits_kernel,
         {"hidden": "*bf16", "weight": "*bf16", "indices": "*i64", "logits": "*fp32",
          "block_max": "*fp32", "block_sum": "*fp32"},
         {"BLOCK_K": 32, "BLOCK_H": 128, "ACC": tl.float32}),
        (subset._subset_softmax_kernel,
         {"logits": "*fp32", "block_max": "*fp32", "block_sum": "*fp32", "probs": "*fp32"},
         {"BLOCK_K": 32, "BLOCK_BLOCKS": 4}),
    ]  # fmt: skip


@needs_triton
@pytest.mark.skipif(K.INTERPRETING, reason="kernels are interpreted in this process")
def test_triton_kernels_compile_for_sm90():
    """Every kernel goes through Triton's compiler to a cubin for sm_90 (no GPU is needed)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    for kernel, pointers, constexprs in _kernel_signatures():
        names = [p.name for p in kernel.params]
        signature = {n: "constexpr" if n in constexprs else pointers.get(n, "i32") for n in names}
        src = ASTSource(fn=kernel, signature=signature, constexprs=constexprs)
        compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32))
        assert compiled.asm["cubin"], kernel.__name__
        if kernel is speculative._speculative_accept_kernel:
            assert "div.full" not in compiled.asm["ptx"], "division must be correctly rounded"


INTERP = dict(max_examples=examples(30, 120), deadline=None)


@needs_interp
@settings(**INTERP)
@given(seed=seeds, B=batch, d=n_draft, V=st.one_of(vocab, st.integers(2049, 4500)),
       ties=st.booleans(),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float64]))  # fmt: skip
def test_interp_greedy_triton_matches_reference(seed, B, d, V, ties, dtype):
    # V > 2048 takes several blocks per row: ties across blocks must keep the first.
    check_greedy(K.greedy_accept_triton, "cpu", seed, B, d, V, dtype, ties)


@needs_interp
@settings(**INTERP)
@given(seed=seeds, B=batch, d=n_draft, V=st.one_of(vocab, st.integers(1025, 2100)),
       dtype=st.sampled_from([torch.float32, torch.float64]))  # fmt: skip
def test_interp_speculative_triton_matches_reference(seed, B, d, V, dtype):
    # V > 1024 takes several blocks per scan.
    check_speculative(K.speculative_accept_triton, "cpu", seed, B, d, V, dtype, exact=False)


@needs_interp
@settings(**INTERP)
@given(seed=seeds, B=batch, H=st.integers(1, 300), V=vocab, Kn=st.integers(1, 300),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float64]))  # fmt: skip
def test_interp_subset_triton_matches_reference(seed, B, H, V, Kn, dtype):
    check_subset(K.subset_logits_triton, "cpu", seed, B, H, V, Kn, dtype, atol=1e-4)


@needs_interp
def test_interp_golden_cases_and_ops_dispatch_to_triton():
    check_greedy_golden(K.greedy_accept_triton, "cpu")
    check_speculative_golden(K.speculative_accept_triton, "cpu")
    assert K.implementation(torch.zeros(1)) == "triton"
    check_greedy(K.greedy_accept, "cpu", 0, 2, 4, 3000, torch.float32, ties=True)  # 2 blocks


@needs_triton
def test_triton_interpreter_in_subprocess():
    """Run the test_interp_* tests in a child pytest started with TRITON_INTERPRET=1."""
    if K.INTERPRETING:
        pytest.skip("this process runs the test_interp_* tests itself")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    cmd = [sys.executable, "-m", "pytest", __file__, "-q", "-p", "no:cacheprovider",
           "-p", "no:warnings", "-k", "test_interp_"]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    # the summary line: the last stdout line that counts results (a plugin may warn after it)
    summary = [line for line in proc.stdout.splitlines() if " passed" in line or "failed" in line]
    summary = summary[-1] if summary else ""
    n_interp = sum(name.startswith("test_interp_") for name in globals())
    assert re.search(rf"\b{n_interp} passed\b", summary) and "skipped" not in summary, out[-3000:]


# ---------------------------------------------------------------- on a GPU (compiled Triton)


GPU = dict(max_examples=examples(60, 240), deadline=None)


def _require_triton_on_cuda():
    if K.implementation(torch.zeros(1, device="cuda")) != "triton":
        pytest.skip("triton is not installed: the ops run the torch reference on CUDA")


@pytest.mark.gpu
@settings(**GPU)
@given(seed=seeds, B=batch, d=n_draft, V=st.one_of(vocab, st.integers(2049, 40000)),
       ties=st.booleans(),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16,
                              torch.float64]))  # fmt: skip
def test_gpu_greedy_op_matches_reference(seed, B, d, V, ties, dtype):
    _require_triton_on_cuda()
    check_greedy(K.greedy_accept, "cuda", seed, B, d, V, dtype, ties)


@pytest.mark.gpu
@settings(**GPU)
@given(seed=seeds, B=batch, d=n_draft, V=st.one_of(vocab, st.integers(1025, 40000)),
       dtype=st.sampled_from([torch.float32, torch.float64]))  # fmt: skip
def test_gpu_speculative_op_matches_reference(seed, B, d, V, dtype):
    _require_triton_on_cuda()
    check_speculative(K.speculative_accept, "cuda", seed, B, d, V, dtype, exact=False)


@pytest.mark.gpu
@settings(**GPU)
@given(seed=seeds, B=batch, H=st.integers(1, 1024), V=vocab, Kn=st.integers(1, 300),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float64]))  # fmt: skip
def test_gpu_subset_op_matches_reference(seed, B, H, V, Kn, dtype):
    _require_triton_on_cuda()
    check_subset(K.subset_logits, "cuda", seed, B, H, V, Kn, dtype, atol=1e-3)


@pytest.mark.gpu
def test_gpu_golden_cases_and_no_host_sync():
    """The acceptance ops capture into a CUDA graph, which fails on any host sync."""
    _require_triton_on_cuda()
    check_greedy_golden(K.greedy_accept, "cuda")
    check_speculative_golden(K.speculative_accept, "cuda")
    greedy_args = to("cuda", *greedy_inputs(0, 2, 5, 1000, torch.float32, ties=True))
    spec_args = to("cuda", *speculative_inputs(0, 2, 5, 1000, torch.float32))
    K.greedy_accept(*greedy_args), K.speculative_accept(*spec_args)  # compile outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_g = K.greedy_accept(*greedy_args)
        out_s = K.speculative_accept(*spec_args)
    graph.replay()
    torch.cuda.synchronize()
    ref_g = verify.greedy_accept(*(t.cpu() for t in greedy_args))
    assert all(torch.equal(a.cpu(), b) for a, b in zip(out_g, ref_g, strict=True))
    spec_cpu = tuple(t.cpu() for t in spec_args)
    assert_same_or_cdf_tie(spec_cpu, verify.speculative_accept(*spec_cpu), out_s)
