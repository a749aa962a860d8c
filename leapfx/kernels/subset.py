"""``leapfx::subset_logits``: logits over a subset of the vocabulary, fused with their softmax.

SpecEE's exit predictor looks at a handful of candidate tokens, not the whole vocabulary: for
``hidden [B, H]``, an LM-head ``weight [V, H]`` and ``indices [K]`` it needs

    logits = hidden @ weight[indices].T      # [B, K]
    probs  = softmax(logits, dim=-1)          # [B, K], a distribution over the subset

Both come back in float32 (float64 if an input is float64) whatever the input dtype, and the
products accumulate in that dtype, so the features do not depend on whether the model runs in
bfloat16. The torch reference, :func:`subset_logits_reference`, materialises ``weight[indices]``;
the Triton version never does:

1. ``_subset_logits_kernel``, one program per ``(b, block of K)``, gathers its weight rows block by
   block of ``H``, writes the logits and the block's softmax statistics (its max ``m`` and
   ``sum(exp(logit - m))``);
2. ``_subset_softmax_kernel`` combines the per-block statistics of its row (the online-softmax
   rescaling) and writes ``exp(logit - max) / sum``.

The two implementations agree to float rounding (the dot products add in different orders).
``indices`` must lie in ``[0, V)``: checking that would sync with the host, so out-of-range
indices raise in the reference and read out of bounds in Triton. Gradients flow to ``hidden`` and
``weight`` (torch ops in backward) so that a predictor can be trained through the op.
"""

from __future__ import annotations

import torch

from leapfx.kernels import _triton
from leapfx.kernels._triton import HAS_TRITON, tl
from leapfx.kernels._validate import check_floating, check_integer, check_same_device

BLOCK_K = 32  # subset rows per program
MAX_BLOCK_H = 128  # hidden features per step of the dot product

if HAS_TRITON:

    @_triton.jit
    def _subset_logits_kernel(
        hidden, weight, indices, logits, block_max, block_sum,
        K, H,
        stride_hb, stride_hh, stride_wv, stride_wh, stride_i,
        BLOCK_K: tl.constexpr, BLOCK_H: tl.constexpr, ACC: tl.constexpr,
    ):  # fmt: skip
        b = tl.program_id(0).to(tl.int64)
        kb = tl.program_id(1)
        k = kb * BLOCK_K + tl.arange(0, BLOCK_K)
        in_k = k < K
        rows = tl.load(indices + k * stride_i, mask=in_k, other=0).to(tl.int64)  # [BLOCK_K]
        acc = tl.zeros((BLOCK_K,), ACC)
        for h0 in range(0, H, BLOCK_H):
            h = h0 + tl.arange(0, BLOCK_H)
            in_h = h < H
            x = tl.load(hidden + b * stride_hb + h * stride_hh, mask=in_h, other=0.0)
            w = tl.load(
                weight + rows[:, None] * stride_wv + h[None, :] * stride_wh,
                mask=in_k[:, None] & in_h[None, :],
                other=0.0,
            )  # [BLOCK_K, BLOCK_H]
            acc += tl.sum(w.to(ACC) * x.to(ACC)[None, :], 1)
        tl.store(logits + b * K + k, acc, mask=in_k)
        m = tl.max(tl.where(in_k, acc, float("-inf")), 0)
        s = tl.sum(tl.where(in_k, tl.exp(acc - m), 0.0), 0)
        n_blocks = tl.num_programs(1)
        tl.store(block_max + b * n_blocks + kb, m)
        tl.store(block_sum + b * n_blocks + kb, s)

    @_triton.jit
    def _subset_softmax_kernel(
        logits, block_max, block_sum, probs, K, n_blocks,
        BLOCK_K: tl.constexpr, BLOCK_BLOCKS: tl.constexpr,
    ):  # fmt: skip
        b = tl.program_id(0).to(tl.int64)
        kb = tl.program_id(1)
        j = tl.arange(0, BLOCK_BLOCKS)
        in_j = j < n_blocks
        ms = tl.load(block_max + b * n_blocks + j, mask=in_j, other=float("-inf"))
        ss = tl.load(block_sum + b * n_blocks + j, mask=in_j, other=0.0)
        m = tl.max(ms, 0)
        total = tl.sum(tl.where(in_j, ss * tl.exp(ms - m), 0.0), 0)
        k = kb * BLOCK_K + tl.arange(0, BLOCK_K)
        in_k = k < K
        x = tl.load(logits + b * K + k, mask=in_k, other=0.0)
        tl.store(probs + b * K + k, tl.exp(x - m) / total, mask=in_k)


def subset_logits_reference(
    hidden: torch.Tensor, weight: torch.Tensor, indices: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch reference: gather, matmul and softmax in :func:`result_dtype`."""
    dtype = result_dtype(hidden, weight)
    # index_select and linear: the same numbers as weight[indices] and @ .T, fewer dispatches
    # (the exit predictors call this once per active layer of every decoded token).
    rows = weight.index_select(0, indices).to(dtype)  # [K, H]
    logits = torch.nn.functional.linear(hidden.to(dtype), rows)  # [B, K]
    return logits, torch.softmax(logits, dim=-1)


def subset_logits_triton(
    hidden: torch.Tensor, weight: torch.Tensor, indices: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton implementation (needs triton; CUDA tensors, or CPU under TRITON_INTERPRET=1)."""
    _triton.require("subset_logits_triton")
    _check(hidden, weight, indices)
    B, H = hidden.shape
    K = indices.shape[0]
    device, dtype = hidden.device, result_dtype(hidden, weight)
    logits = torch.empty(B, K, dtype=dtype, device=device)  # [B, K]
    probs = torch.empty(B, K, dtype=dtype, device=device)  # [B, K]
    if B == 0 or K == 0:
        return logits, probs
    n_blocks = _triton.cdiv(K, BLOCK_K)
    block_max = torch.empty(B, n_blocks, dtype=dtype, device=device)
    block_sum = torch.empty(B, n_blocks, dtype=dtype, device=device)
    with _triton.on_device(hidden):
        _subset_logits_kernel[(B, n_blocks)](
            hidden, weight, indices, logits, block_max, block_sum,
            K, H,
            *hidden.stride(), *weight.stride(), *indices.stride(),
            BLOCK_K=BLOCK_K, BLOCK_H=min(_triton.next_power_of_2(H), MAX_BLOCK_H),
            ACC=tl.float64 if dtype == torch.float64 else tl.float32,
        )  # fmt: skip
        _subset_softmax_kernel[(B, n_blocks)](
            logits, block_max, block_sum, probs, K, n_blocks,
            BLOCK_K=BLOCK_K, BLOCK_BLOCKS=_triton.next_power_of_2(n_blocks),
        )  # fmt: skip
    return logits, probs


def result_dtype(hidden: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """float32, or float64 when ``hidden`` or ``weight`` is float64 (so gradcheck can run)."""
    return torch.promote_types(torch.promote_types(hidden.dtype, weight.dtype), torch.float32)


def _check(hidden: torch.Tensor, weight: torch.Tensor, indices: torch.Tensor) -> None:
    check_floating("hidden", hidden)
    check_floating("weight", weight)
    check_integer("indices", indices)
    if hidden.dim() != 2 or weight.dim() != 2 or indices.dim() != 1:
        raise ValueError(
            "hidden must be [B, H], weight [V, H] and indices [K]; got "
            f"{tuple(hidden.shape)}, {tuple(weight.shape)} and {tuple(indices.shape)}"
        )
    if hidden.shape[1] != weight.shape[1]:
        raise ValueError(
            f"hidden [B, H] and weight [V, H] must share H; got {tuple(hidden.shape)} and "
            f"{tuple(weight.shape)}"
        )
    check_same_device(hidden=hidden, weight=weight, indices=indices)


@torch.library.custom_op("leapfx::subset_logits", mutates_args=())
def subset_logits(
    hidden: torch.Tensor, weight: torch.Tensor, indices: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits of the vocabulary rows ``indices [K]`` of ``weight [V, H]`` for ``hidden [B, H]``,
    and their softmax over the subset: ``(logits [B, K], probs [B, K])``, float32 (float64 if
    an input is).

    Runs Triton or the torch reference per :func:`leapfx.kernels.implementation`.

    >>> logits, probs = subset_logits(torch.ones(1, 2), torch.eye(2), torch.tensor([1, 1]))
    >>> logits, probs
    (tensor([[1., 1.]]), tensor([[0.5000, 0.5000]]))
    """
    _check(hidden, weight, indices)
    if _triton.implementation(hidden) == "triton":
        return subset_logits_triton(hidden, weight, indices)
    return subset_logits_reference(hidden, weight, indices)


@subset_logits.register_fake
def _(hidden: torch.Tensor, weight: torch.Tensor, indices: torch.Tensor):
    _check(hidden, weight, indices)
    shape, dtype = (hidden.shape[0], indices.shape[0]), result_dtype(hidden, weight)
    return hidden.new_empty(shape, dtype=dtype), hidden.new_empty(shape, dtype=dtype)


def _setup_context(ctx, inputs, output) -> None:
    hidden, weight, indices = inputs
    ctx.save_for_backward(hidden, weight, indices, output[1])
    ctx.weight_shape = weight.shape


def _backward(ctx, grad_logits: torch.Tensor, grad_probs: torch.Tensor):
    hidden, weight, indices, probs = ctx.saved_tensors
    # Through the softmax: dL/dlogits += probs * (g - <g, probs>).
    grad = grad_logits + probs * (grad_probs - (grad_probs * probs).sum(-1, keepdim=True))
    grad_hidden = grad_weight = None
    if ctx.needs_input_grad[0]:
        grad_hidden = (grad @ weight[indices].to(grad.dtype)).to(hidden.dtype)  # [B, H]
    if ctx.needs_input_grad[1]:
        rows = (grad.T @ hidden.to(grad.dtype)).to(weight.dtype)  # [K, H]
        grad_weight = weight.new_zeros(ctx.weight_shape).index_add_(0, indices, rows)  # [V, H]
    return grad_hidden, grad_weight, None


subset_logits.register_autograd(_backward, setup_context=_setup_context)
