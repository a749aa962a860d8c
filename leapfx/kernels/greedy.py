"""``leapfx::greedy_accept``: greedy verification on device (argmax, prefix match, next token).

The rule is :func:`leapfx.kernels.reference.greedy_accept`, which is also the torch reference: with
``t = argmax(target_logits)`` (``[B, d+1]``), ``n_accepted`` is the length of the prefix where
``draft_tokens == t[:, :d]`` and ``next_token = t[b, n_accepted[b]]`` (the correction, or the
bonus token when all ``d`` drafts are accepted).

The Triton version takes two launches and never syncs with the host:

1. ``_row_argmax_kernel``, one program per ``(b, j)`` row, scans ``V`` in blocks and keeps the
   running maximum with a strict ``>``, so ties resolve to the lowest index as in
   ``torch.argmax``; a NaN wins like in torch (the first NaN's index).
2. ``_prefix_match_kernel``, one program per batch row, takes the first mismatch (or ``d``) as
   ``n_accepted`` and reads ``next_token`` from the argmax row.

Argmax involves no arithmetic, so the two implementations agree exactly for every dtype.
"""

from __future__ import annotations

import torch

from leapfx.kernels import _triton
from leapfx.kernels import reference as verify
from leapfx.kernels._triton import HAS_TRITON, tl
from leapfx.kernels._validate import check_draft, check_floating, check_same_device

# One program scans a row in blocks of at most this many logits (a register-sized tile).
MAX_BLOCK_V = 2048

if HAS_TRITON:

    @_triton.jit
    def _row_argmax_kernel(
        logits, tokens, V, stride_b, stride_j, stride_v, BLOCK_V: tl.constexpr, ACC: tl.constexpr
    ):
        b = tl.program_id(0).to(tl.int64)
        j = tl.program_id(1).to(tl.int64)
        row = logits + b * stride_b + j * stride_j
        offs = tl.arange(0, BLOCK_V)
        best = tl.full((), float("-inf"), ACC)
        best_index = tl.full((), 0, tl.int32)
        first_nan = tl.full((), V, tl.int32)
        for v0 in range(0, V, BLOCK_V):
            v = v0 + offs
            in_row = v < V
            # ACC (float32, or float64 for float64 logits) holds every logit exactly: no new ties.
            x = tl.load(row + v * stride_v, mask=in_row, other=float("-inf")).to(ACC)
            is_nan = x != x
            first_nan = tl.minimum(first_nan, tl.min(tl.where(is_nan & in_row, v, V), 0))
            block_max, block_index = tl.max(
                tl.where(is_nan, float("-inf"), x),
                0,
                return_indices=True,
                return_indices_tie_break_left=True,
            )
            better = block_max > best  # strict: an earlier block keeps a tie
            best_index = tl.where(better, v0 + block_index, best_index)
            best = tl.where(better, block_max, best)
        token = tl.where(first_nan < V, first_nan, best_index)
        tl.store(tokens + b * tl.num_programs(1) + j, token.to(tl.int64))

    @_triton.jit
    def _prefix_match_kernel(
        draft, tokens, n_accepted, next_token, d, stride_b, stride_d, BLOCK_D: tl.constexpr
    ):
        b = tl.program_id(0).to(tl.int64)
        i = tl.arange(0, BLOCK_D)
        in_draft = i < d
        x = tl.load(draft + b * stride_b + i * stride_d, mask=in_draft, other=0).to(tl.int64)
        t = tl.load(tokens + b * (d + 1) + i, mask=in_draft, other=0)  # [BLOCK_D] int64
        n = tl.min(tl.where(in_draft & (x != t), i, d), 0)  # first rejection, or d
        tl.store(n_accepted + b, n.to(tl.int64))
        tl.store(next_token + b, tl.load(tokens + b * (d + 1) + n))


def greedy_accept_reference(
    draft_tokens: torch.Tensor, target_logits: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch reference: :func:`leapfx.kernels.reference.greedy_accept`."""
    return verify.greedy_accept(draft_tokens, target_logits)


def greedy_accept_triton(
    draft_tokens: torch.Tensor, target_logits: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton implementation (needs triton; CUDA tensors, or CPU under TRITON_INTERPRET=1)."""
    _triton.require("greedy_accept_triton")
    _check(draft_tokens, target_logits)
    B, d = draft_tokens.shape
    V = target_logits.shape[2]
    device = target_logits.device
    n_accepted, next_token = _triton.accept_outputs(B, device)
    if B == 0:
        return n_accepted, next_token
    tokens = torch.empty(B, d + 1, dtype=torch.long, device=device)  # [B, d+1] argmax
    with _triton.on_device(target_logits):
        _row_argmax_kernel[(B, d + 1)](
            target_logits, tokens, V, *target_logits.stride(),
            BLOCK_V=min(_triton.next_power_of_2(V), MAX_BLOCK_V),
            ACC=tl.float64 if target_logits.dtype == torch.float64 else tl.float32,
        )  # fmt: skip
        _prefix_match_kernel[(B,)](
            draft_tokens, tokens, n_accepted, next_token, d, *draft_tokens.stride(),
            BLOCK_D=_triton.next_power_of_2(d),
        )  # fmt: skip
    return n_accepted, next_token


def _check(draft_tokens: torch.Tensor, target_logits: torch.Tensor) -> None:
    check_draft(draft_tokens, target_logits, "target_logits")
    check_floating("target_logits", target_logits)
    check_same_device(draft_tokens=draft_tokens, target_logits=target_logits)


@torch.library.custom_op("leapfx::greedy_accept", mutates_args=())
def greedy_accept(
    draft_tokens: torch.Tensor, target_logits: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy verification: ``draft_tokens [B, d]``, ``target_logits [B, d+1, V]`` ->
    ``(n_accepted [B], next_token [B])`` (int64), on the device of the logits, no host sync.

    Runs Triton or the torch reference per :func:`leapfx.kernels.implementation`.

    >>> logits = torch.eye(4)[[1, 2, 3]][None]  # target argmax: 1, 2, 3
    >>> greedy_accept(torch.tensor([[1, 0]]), logits)
    (tensor([1]), tensor([2]))
    """
    _check(draft_tokens, target_logits)
    if _triton.implementation(target_logits) == "triton":
        return greedy_accept_triton(draft_tokens, target_logits)
    return greedy_accept_reference(draft_tokens, target_logits)


@greedy_accept.register_fake
def _(draft_tokens: torch.Tensor, target_logits: torch.Tensor):
    _check(draft_tokens, target_logits)
    B = draft_tokens.shape[0]
    return (
        target_logits.new_empty((B,), dtype=torch.long),
        target_logits.new_empty((B,), dtype=torch.long),
    )
