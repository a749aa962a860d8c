"""``leapfx::speculative_accept``: the speculative-sampling step on device, from given uniforms.

The rule is :func:`leapfx.kernels.reference.speculative_accept`, which is also the torch reference
(Leviathan et al. 2023, Algorithm 1, with explicit uniforms):

    accept x_i while u_accept[i] < min(1, p_i(x_i) / q_i(x_i))   (q_i(x_i) = 0: iff p_i(x_i) > 0)
    n = the first rejection, or d
    next_token = sample(normalize(max(p_n - q_n, 0)), u_sample)   if n < d (all-zero: p_n)
               = sample(p_{d+1}, u_sample)                         if n = d

where ``sample`` (:func:`leapfx.runtime.sampling.sample`) is inverse-CDF: the first token whose
cumulative probability exceeds ``max(u, 0) * cdf[-1]``, never a token of probability zero.

The Triton kernel runs one program per batch row and never syncs with the host: the accept test
for all ``d`` drafts at once (a gather of ``p(x)`` and ``q(x)``), then three scans over ``V`` of
the emitted row: the residual's mass, the CDF's total, and the first CDF entry above ``u * total``.
Division is correctly rounded (``div_rn``) and FMA contraction is off, so ``n_accepted`` matches
the reference exactly. ``next_token`` can differ only where ``u * total`` falls within rounding
of a CDF boundary: the mass and the CDF are sums, and no two implementations (torch on CPU and on
CUDA included) add in the same order. The tests check that every mismatch is such a tie.

Probabilities must be float32 (what :func:`leapfx.runtime.sampling.probs` returns) or float64.
"""

from __future__ import annotations

import torch

from leapfx.kernels import _triton
from leapfx.kernels import reference as verify
from leapfx.kernels._triton import HAS_TRITON, tl
from leapfx.kernels._validate import (
    check_draft,
    check_floating,
    check_same_device,
)

PROB_DTYPES = (torch.float32, torch.float64)
# One program scans the emitted row in blocks of at most this many probabilities.
MAX_BLOCK_V = 1024

if HAS_TRITON:

    @_triton.jit
    def _div(a, b, DTYPE: tl.constexpr):
        """Correctly rounded a / b (float32 ``/`` on a GPU is approximate; float64 is exact)."""
        if DTYPE == tl.float64:
            return a / b
        else:
            return tl.math.div_rn(a, b)

    @_triton.jit
    def _emitted_chunk(
        p_row, q_row, v, V, stride_pv, stride_qv, use_residual, mass, DTYPE: tl.constexpr
    ):
        """Block ``v`` of the distribution emitted after the accept test (unnormalised for p)."""
        p = tl.load(p_row + v * stride_pv, mask=v < V, other=0.0)
        # The q row is read only for a residual. (A mask `in_row & scalar_bool` would be neater,
        # but Triton 3.9's interpreter turns that into int32 and rejects it as a mask.)
        q = tl.load(q_row + v * stride_qv, mask=v < tl.where(use_residual, V, 0), other=0.0)
        residual = tl.maximum(p - q, 0.0)
        safe_mass = tl.where(use_residual, mass, 1.0)
        return tl.where(use_residual, _div(residual, safe_mass, DTYPE), p)

    @_triton.jit
    def _speculative_accept_kernel(
        draft, q, p, u_accept, u_sample, n_accepted, next_token,
        d, V,
        stride_xb, stride_xd,
        stride_qb, stride_qd, stride_qv,
        stride_pb, stride_pd, stride_pv,
        stride_ub, stride_ud, stride_sb,
        BLOCK_D: tl.constexpr, BLOCK_V: tl.constexpr, DTYPE: tl.constexpr,
    ):  # fmt: skip
        b = tl.program_id(0).to(tl.int64)

        # Accept test for every draft position at once.
        i = tl.arange(0, BLOCK_D)
        in_draft = i < d
        x = tl.load(draft + b * stride_xb + i * stride_xd, mask=in_draft, other=0).to(tl.int64)
        q_x = tl.load(q + b * stride_qb + i * stride_qd + x * stride_qv, mask=in_draft, other=1.0)
        p_x = tl.load(p + b * stride_pb + i * stride_pd + x * stride_pv, mask=in_draft, other=1.0)
        ratio = tl.minimum(_div(p_x, tl.where(q_x > 0, q_x, 1.0), DTYPE), 1.0)
        accept_prob = tl.where(q_x > 0, ratio, tl.where(p_x > 0, 1.0, 0.0))
        u = tl.load(u_accept + b * stride_ub + i * stride_ud, mask=in_draft, other=0.0)
        rejected = in_draft & ~(u < accept_prob)  # a NaN rejects, as in the reference
        n = tl.min(tl.where(rejected, i, d), 0)  # first rejection, or d
        tl.store(n_accepted + b, n.to(tl.int64))

        # The emitted row: residual_n (q row n exists only when n < d), or p_{d+1}.
        use_residual = n < d
        p_row = p + b * stride_pb + n * stride_pd
        q_row = q + b * stride_qb + n * stride_qd
        offs = tl.arange(0, BLOCK_V)
        zero = tl.full((), 0.0, DTYPE)
        mass = zero
        for v0 in range(0, V, BLOCK_V):
            v = v0 + offs
            in_row = v < V
            pv = tl.load(p_row + v * stride_pv, mask=in_row, other=0.0)
            qv = tl.load(q_row + v * stride_qv, mask=v < tl.where(use_residual, V, 0), other=0.0)
            mass += tl.sum(tl.maximum(pv - qv, 0.0), 0)
        use_residual = use_residual & (mass > 0)  # all-zero residual: p_n == q_n, emit p_n

        # Inverse-CDF sample. The total is the CDF's last entry computed exactly as in the search
        # below (same blocks, same scan), so u < 1 never lands past the last token with mass.
        total = zero
        for v0 in range(0, V, BLOCK_V):
            v = v0 + offs
            dist = _emitted_chunk(
                p_row, q_row, v, V, stride_pv, stride_qv, use_residual, mass, DTYPE
            )
            total = tl.max(total + tl.cumsum(dist, 0), 0)  # CDF is non-decreasing
        u_s = tl.maximum(tl.load(u_sample + b * stride_sb).to(DTYPE), 0.0)
        threshold = u_s * total
        carry = zero
        first_above = tl.full((), V, tl.int32)
        last_with_mass = tl.full((), -1, tl.int32)
        for v0 in range(0, V, BLOCK_V):
            v = v0 + offs
            in_row = v < V
            dist = _emitted_chunk(
                p_row, q_row, v, V, stride_pv, stride_qv, use_residual, mass, DTYPE
            )
            cdf = carry + tl.cumsum(dist, 0)
            first_above = tl.minimum(
                first_above, tl.min(tl.where(in_row & (cdf > threshold), v, V), 0)
            )
            last_with_mass = tl.maximum(
                last_with_mass, tl.max(tl.where(in_row & (dist > 0), v, -1), 0)
            )
            carry = tl.max(cdf, 0)
        # u >= 1 (or rounding) can pass the last token with mass: clamp to it, as sample() does.
        last_with_mass = tl.where(last_with_mass < 0, V - 1, last_with_mass)
        tl.store(next_token + b, tl.minimum(first_above, last_with_mass).to(tl.int64))


def speculative_accept_reference(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
    u_accept: torch.Tensor,
    u_sample: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch reference: :func:`leapfx.kernels.reference.speculative_accept`."""
    return verify.speculative_accept(draft_tokens, draft_probs, target_probs, u_accept, u_sample)


def speculative_accept_triton(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
    u_accept: torch.Tensor,
    u_sample: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton implementation (needs triton; CUDA tensors, or CPU under TRITON_INTERPRET=1)."""
    _triton.require("speculative_accept_triton")
    _check(draft_tokens, draft_probs, target_probs, u_accept, u_sample)
    B, d = draft_tokens.shape
    V = target_probs.shape[2]
    n_accepted, next_token = _triton.accept_outputs(B, target_probs.device)
    if B == 0:
        return n_accepted, next_token
    # With d = 0 draft_probs is empty: pass target_probs as a never-read stand-in pointer.
    q = draft_probs if d > 0 else target_probs
    with _triton.on_device(target_probs):
        _speculative_accept_kernel[(B,)](
            draft_tokens, q, target_probs, u_accept, u_sample, n_accepted, next_token,
            d, V,
            *draft_tokens.stride(), *q.stride(), *target_probs.stride(),
            *u_accept.stride(), *u_sample.stride(),
            BLOCK_D=_triton.next_power_of_2(d),
            BLOCK_V=min(_triton.next_power_of_2(V), MAX_BLOCK_V),
            DTYPE=tl.float64 if target_probs.dtype == torch.float64 else tl.float32,
            enable_fp_fusion=False,  # no FMA contraction: round like the reference
        )  # fmt: skip
    return n_accepted, next_token


def _check(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
    u_accept: torch.Tensor,
    u_sample: torch.Tensor,
) -> None:
    check_draft(draft_tokens, target_probs, "target_probs")
    check_floating("target_probs", target_probs, PROB_DTYPES)
    if draft_probs.dtype != target_probs.dtype:
        raise ValueError(
            f"draft_probs and target_probs must have one dtype; got {draft_probs.dtype} and "
            f"{target_probs.dtype}"
        )
    B, d = draft_tokens.shape
    V = target_probs.shape[2]
    if draft_probs.dim() != 3 or tuple(draft_probs.shape) != (B, d, V):
        raise ValueError(
            f"draft_probs must be [B, d, V] = [{B}, {d}, {V}]; got {tuple(draft_probs.shape)}"
        )
    if u_accept.dim() != 2 or tuple(u_accept.shape) != (B, d) or tuple(u_sample.shape) != (B,):
        raise ValueError(
            f"u_accept must be [B, d] = [{B}, {d}] and u_sample [B] = [{B}]; got "
            f"{tuple(u_accept.shape)} and {tuple(u_sample.shape)}"
        )
    check_floating("u_accept", u_accept)
    check_floating("u_sample", u_sample)
    check_same_device(
        draft_tokens=draft_tokens, draft_probs=draft_probs, target_probs=target_probs,
        u_accept=u_accept, u_sample=u_sample,
    )  # fmt: skip


@torch.library.custom_op("leapfx::speculative_accept", mutates_args=())
def speculative_accept(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
    u_accept: torch.Tensor,
    u_sample: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative-sampling step: ``draft_tokens [B, d]``, ``draft_probs [B, d, V]``,
    ``target_probs [B, d+1, V]``, uniforms ``u_accept [B, d]`` and ``u_sample [B]`` in [0, 1) ->
    ``(n_accepted [B], next_token [B])`` (int64), on device, no host sync.

    Runs Triton or the torch reference per :func:`leapfx.kernels.implementation`.

    >>> q = torch.tensor([[[0.5, 0.5]]]); p = torch.tensor([[[0.25, 0.75], [1.0, 0.0]]])
    >>> speculative_accept(torch.tensor([[0]]), q, p, torch.tensor([[0.6]]), torch.tensor([0.1]))
    (tensor([0]), tensor([1]))
    """
    _check(draft_tokens, draft_probs, target_probs, u_accept, u_sample)
    args = (draft_tokens, draft_probs, target_probs, u_accept, u_sample)
    if _triton.implementation(target_probs) == "triton":
        return speculative_accept_triton(*args)
    return speculative_accept_reference(*args)


@speculative_accept.register_fake
def _(draft_tokens, draft_probs, target_probs, u_accept, u_sample):
    _check(draft_tokens, draft_probs, target_probs, u_accept, u_sample)
    B = draft_tokens.shape[0]
    return (
        target_probs.new_empty((B,), dtype=torch.long),
        target_probs.new_empty((B,), dtype=torch.long),
    )
