"""Vocabulary-subset drafting (FR-Spec, arXiv 2502.14856): a draft LM head over N rows only.

On a small real model the LM head dominates a draft: SmolLM2-135M's 49,152 x 576 head costs as
much as a quarter of the model. A drafter rarely proposes a rare token (and a rare token is
rarely accepted), so the draft head computes the logits of the ``N`` most frequent tokens of
the training data only (``indices`` [N], full-vocabulary ids) and hands them back at their own
ids in a full-vocabulary row filled with ``-inf``::

    z_S   = W[S] h + b[S]                     # [B, S, N]: N of the V rows, gathered once
    z     = full((B, S, V), -inf); z[..., S] = z_S

so everything after the head is unchanged: a greedy draft is the argmax over the subset (an
id of the full vocabulary), a sampling draft's distribution q = softmax(z) is the one over the
subset and zero elsewhere, which rejection sampling handles exactly (a target token outside
the subset is never drafted, only emitted as the correction). Verification runs the full head:
the output is the same as without the subset, token for token.

The rows are gathered once (``set_ranking``), not per call: the host's LM head is frozen in
every recipe (only inserted parts train), and a contiguous [N, H] matrix costs one GEMV. The
copy is N x H of the head's dtype (8192 rows of SmolLM2: 4.7M values).

    >>> head = SubsetLMHead.from_head(lm_head, ranking[:8192])
    >>> head(h).shape == (*h.shape[:-1], lm_head.weight.shape[0])
    True
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels.cpu import pack_weight
from ..kernels.cpu_blocks import Blocks
from .blocks import BlockLinear, dequantize
from .kernel_layers import require_kernels


class SubsetLMHead(nn.Module):
    """``lm_head`` restricted to the rows ``indices`` [N]; logits ``-inf`` off the subset."""

    def __init__(self, rows: torch.Tensor, bias: torch.Tensor | None, indices: torch.Tensor,
                 vocab_size: int, blocks: Blocks | None = None) -> None:  # fmt: skip
        super().__init__()
        self.vocab_size = vocab_size
        # A head held as GGUF blocks (BlockLinear): the subset's rows as blocks too, which the
        # kernel multiplies (KernelSubsetHead); ``rows`` are their dequantized floats.
        self.register_buffer("rows_blocks", None if blocks is None else blocks.data,
                             persistent=False)  # fmt: skip
        self.blocks_fmt = None if blocks is None else blocks.fmt
        # Derived from the host's head and the ranking (saved with the parts), so not saved.
        self.register_buffer("rows", rows, persistent=False)  # [N, H]
        self.register_buffer("bias", bias, persistent=False)  # [N] or None
        self.register_buffer("indices", indices, persistent=False)  # [N] int64, full-vocab ids

    @classmethod
    def from_head(cls, lm_head: nn.Module, indices: torch.Tensor) -> SubsetLMHead:
        """The subset of ``lm_head`` (an ``nn.Linear`` [V, H]) at ``indices`` [N]."""
        bias = getattr(lm_head, "bias", None)
        if isinstance(lm_head, BlockLinear):  # the subset's blocks, not the whole head's floats
            idx = indices.to(device=lm_head.blocks.device, dtype=torch.long)
            blocks = lm_head.weights.rows(idx)
            return cls(dequantize(blocks), None, idx, lm_head.out_features, blocks)
        weight = lm_head.weight
        idx = indices.to(device=weight.device, dtype=torch.long)
        with torch.no_grad():
            rows = weight.index_select(0, idx).clone()
            sub_bias = None if bias is None else bias.index_select(0, idx).clone()
        return cls(rows, sub_bias, idx, weight.shape[0])

    @property
    def blocks(self) -> Blocks | None:
        """The subset's rows as GGUF blocks (a head held as blocks), else None."""
        if self.rows_blocks is None:
            return None
        return Blocks(self.rows_blocks, self.blocks_fmt, *self.rows.shape)

    @property
    def draft_vocab(self) -> int:
        return self.indices.numel()

    @torch.no_grad()
    def set_ranking(self, lm_head: nn.Module, indices: torch.Tensor) -> None:
        """Gather the rows of ``indices`` [N] (same N) from ``lm_head`` in place: the stages
        that hold this module see the new subset at once."""
        if indices.numel() != self.draft_vocab:
            raise ValueError(
                f"draft_vocab: the subset holds {self.draft_vocab} rows, got {indices.numel()}"
            )
        idx = indices.to(device=self.indices.device, dtype=torch.long)
        self.indices.copy_(idx)
        if self.rows_blocks is not None and isinstance(lm_head, BlockLinear):
            blocks = lm_head.weights.rows(idx)
            self.rows_blocks.copy_(blocks.data)
            self.rows.copy_(dequantize(blocks))
            return
        self.rows.copy_(lm_head.weight.index_select(0, idx))
        if self.bias is not None:
            self.bias.copy_(lm_head.bias.index_select(0, idx))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden: [B, S, H] -> logits [B, S, V], -inf off the subset
        return self.spread(F.linear(hidden, self.rows, self.bias))  # [B, S, N] -> [B, S, V]

    def spread(self, sub: torch.Tensor) -> torch.Tensor:
        """The subset's logits ``sub`` [..., N] at their ids of the whole vocabulary, among
        ``-inf`` elsewhere: [..., V] (what every computation of the subset's rows returns)."""
        full = sub.new_full((*sub.shape[:-1], self.vocab_size), float("-inf"))
        return full.index_copy(sub.dim() - 1, self.indices, sub)

    def extra_repr(self) -> str:
        return f"draft_vocab={self.draft_vocab}, vocab_size={self.vocab_size}"


class KernelSubsetHead(nn.Module):
    """A :class:`SubsetLMHead` whose N rows multiply through ``leapfx_cpu::small_mm`` on a
    packed copy (``lower(sm, "cpu_kernels")``), as ``KernelLinear`` does for a full head: a
    one-token draft reads the N x H rows once, as one sequential stream per 16 rows, where
    ``F.linear``'s GEMV reads them at about two thirds of that rate. Same numbers up to
    summation order. The copy follows the head: ``set_ranking`` (a fit measuring a new
    ranking) writes its rows in place, which bumps their version, and the next call repacks."""

    def __init__(self, head: SubsetLMHead) -> None:
        super().__init__()
        require_kernels()
        self.head = head
        self._pack()

    def _pack(self) -> None:
        rows = self.head.rows
        blocks = self.head.blocks is not None  # the kernel reads the head's own blocks
        self._blocks_type = self.head.blocks.type_id if blocks else None
        self.register_buffer("rows_packed", None if blocks else pack_weight(rows),
                             persistent=False)  # fmt: skip
        self._packed_version = rows._version

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        head = self.head
        if hidden.dtype != torch.float32 or (torch.is_grad_enabled() and hidden.requires_grad):
            return head(hidden)  # the kernel is float32 and has no backward
        if head.rows_blocks is not None:  # GGUF blocks (a native model's head), as they are
            fmt, (n, k) = self._blocks_type, head.rows.shape
            sub = torch.ops.leapfx_cpu.block_mm(hidden, head.rows_blocks, fmt, n, k)
            return head.spread(sub if head.bias is None else sub + head.bias)
        if head.rows._version != self._packed_version:
            self._pack()
        sub = torch.ops.leapfx_cpu.small_mm(hidden, self.rows_packed, head.draft_vocab)
        return head.spread(sub if head.bias is None else sub + head.bias)
