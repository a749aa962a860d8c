"""Causal attention for CPU decode and verify calls as one C++ op: ``leapfx_cpu::attention``.

A decode step attends one query row (a verify pass d + 1) per head to the cache. Through SDPA
that is ~15 us a layer on a 2-core CPU for the reference model whatever the work, and a
compiled stage (static shapes) attends over the whole cache buffer behind a mask, so its cost
grows with the buffer rather than with the filled prefix. ``cpu_attention.cpp`` reads only the
slots each query may see, grouped heads in place:

=============================  ==================================================================
op                             signature
=============================  ==================================================================
``leapfx_cpu::attention``      ``(q [B, Hq, S, D], k [B, Hkv, L, D], v [B, Hkv, L, D],
                               positions [S] int64, scale) -> [B, S, Hq, D]``: query ``s``
                               attends to slots ``0 .. positions[s]`` (slot ``j`` holds
                               position ``j``), head ``h`` to kv head ``h // (Hq // Hkv)``
``leapfx_cpu::attention_rows`` ``(q, k, v, first [B] int64, last [B, S] int64, scale)``: the
                               same for ragged rows (a left-padded batch, each row at its own
                               length): query ``(b, s)`` attends to slots ``first[b] ..
                               last[b, s]``; a padded row's numbers equal the row's alone;
                               a query before ``first[b]`` (padding) gets zeros
=============================  ==================================================================

float32 only; causal attention without a sliding window, soft-capping or sinks (the layers that
use it check). The numbers equal SDPA's up to summation order, and each query row's do not
depend on how many rows came with it. A kv head's query rows (its group's heads, a verify's or
a prefill's rows) go four at a time, each key and value loaded once for them: as fast as SDPA
or faster from one row to a prefill (docs/quantized.md), so eager kernel layers send it every
row. Built like :mod:`leapfx.kernels.cpu`'s kernels (its own
extension, on first use).
"""

from __future__ import annotations

import functools

import torch

from . import cpu


@functools.cache
def available() -> bool:
    """True once ``leapfx_cpu::attention`` is built and registered (built on the first call)."""
    return cpu.load_ops("attention", "attention_rows", "using SDPA", _register_fakes)


def _register_fakes() -> None:
    @torch.library.register_fake("leapfx_cpu::attention")
    def _fake(q, k, v, positions, scale):
        b, h, s, d = q.shape
        return q.new_empty((b, s, h, d))

    @torch.library.register_fake("leapfx_cpu::attention_rows")
    def _fake_rows(q, k, v, first, last, scale):
        b, h, s, d = q.shape
        return q.new_empty((b, s, h, d))


def attention_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, scale: float
) -> torch.Tensor:
    """The op's contract in torch: SDPA with a boolean mask over the slots, [B, S, Hq, D]."""
    group = q.shape[1] // k.shape[1]
    slots = torch.arange(k.shape[2], device=q.device)
    mask = slots[None, :] <= positions[:, None]  # [S, L]
    out = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1), attn_mask=mask,
        scale=scale,
    )  # fmt: skip
    return out.transpose(1, 2).contiguous()


def attention_rows_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, first: torch.Tensor, last: torch.Tensor,
    scale: float,
) -> torch.Tensor:  # fmt: skip
    """``leapfx_cpu::attention_rows``' contract in torch: SDPA with a boolean mask [B, 1, S, L]
    (query (b, s) sees slots first[b] .. last[b, s]), [B, S, Hq, D]."""
    group = q.shape[1] // k.shape[1]
    slots = torch.arange(k.shape[2], device=q.device)
    mask = (slots >= first[:, None, None]) & (slots <= last[:, :, None])  # [B, S, L]
    out = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1), attn_mask=mask[:, None],
        scale=scale,
    )  # fmt: skip
    empty = ~mask.any(-1)  # [B, S]: padding queries
    return out.transpose(1, 2).masked_fill(empty[:, :, None, None], 0.0).contiguous()
