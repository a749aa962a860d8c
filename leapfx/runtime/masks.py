"""Attention masks for a chunk of queries against the cache, matching HF's own choices.

For ``sdpa`` HF passes no mask (and lets SDPA's ``is_causal`` act) when the chunk is a single
query or fills an empty cache and no sliding window bites; we do the same so that the same kernel
runs and the autoregressive schedule stays bit-identical to HF. Otherwise the mask is explicit:
boolean (True = attend) for ``sdpa``, additive (0 / dtype min) for ``eager``. ``additive=True``
gives ``sdpa`` the float form (0 / -inf) instead: exactly what SDPA turns a boolean mask into on
every call, so the results are the same bit for bit, and a stage that passes one mask to all its
layers converts it once instead of once per layer (6 us of a 35 us attention call for 5 queries).

A batch's left-padded rows, each at its own cache columns, get :func:`row_masks` (eager stages,
built by the runner) or :func:`column_masks` (inside compiled graphs): each row sees its own
tokens up to its own end, never its padding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

SUPPORTED_ATTENTION = ("sdpa", "eager")


@dataclass(frozen=True)
class AttentionLayout:
    """What masks a model needs: HF attention implementation, per-layer kinds, sliding window."""

    impl: str
    kinds: tuple[str, ...]
    window: int | None
    dtype: torch.dtype
    device: torch.device


def chunk_mask(
    impl: str,
    q_start: int,
    q_len: int,
    *,
    window: int | None = None,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    additive: bool = False,
) -> torch.Tensor | None:
    """Mask for queries at positions ``q_start .. q_start+q_len-1`` over keys ``0 .. q_end-1``.

    ``window`` is a sliding window (keys with ``q - k < window`` are visible), or None.
    ``additive`` returns ``sdpa``'s mask as 0 / -inf in ``dtype`` (see the module docstring).
    """
    kv_len = q_start + q_len
    window_bites = window is not None and kv_len >= window
    if impl == "sdpa" and not window_bites and (q_len == 1 or q_start == 0):
        return None
    q_pos = torch.arange(q_start, kv_len, device=device)[:, None]
    k_pos = torch.arange(kv_len, device=device)[None, :]
    visible = k_pos <= q_pos
    if window is not None:
        visible &= k_pos > q_pos - window
    visible = visible[None, None]  # [1, 1, q, kv]
    if impl == "sdpa" and not additive:
        return visible
    zero = torch.zeros((), dtype=dtype, device=device)
    return torch.where(visible, zero, float("-inf") if impl == "sdpa" else torch.finfo(dtype).min)


def masks_for(
    impl: str,
    kinds: list[str],
    q_start: int,
    q_len: int,
    *,
    window: int | None,
    dtype: torch.dtype,
    device: torch.device | str,
    additive: bool = False,
) -> dict[str, torch.Tensor | None]:
    """One mask per attention kind used by the model (``full_attention``/``sliding_attention``)."""
    out: dict[str, torch.Tensor | None] = {}
    for kind in dict.fromkeys(kinds):
        w = window if kind == "sliding_attention" else None
        out[kind] = chunk_mask(
            impl, q_start, q_len, window=w, dtype=dtype, device=device, additive=additive
        )
    return out


def position_mask(
    position_ids: torch.Tensor,
    kv_len,
    *,
    impl: str,
    window: int | None,
    dtype: torch.dtype,
) -> torch.Tensor:
    """Mask [B, 1, S, kv_len] of queries at ``position_ids`` [B, S] over keys 0..kv_len-1.

    Key slot ``k`` holds position ``k``; query ``q`` sees it iff ``k <= q`` (and
    ``k > q - window`` under a sliding window). Boolean (True = attend) for ``sdpa``, additive
    (0 / dtype min) for ``eager``, as HF uses. Built from tensors only, so it traces into
    exported and compiled graphs (``kv_len`` may be symbolic).
    """
    q_pos = position_ids[:, :, None]  # [B, S, 1]
    k_pos = torch.arange(kv_len, device=position_ids.device)[None, None, :]  # [1, 1, kv]
    visible = k_pos <= q_pos
    if window is not None:
        visible = visible & (k_pos > q_pos - window)
    return _mask_of(visible[:, None], impl, dtype)  # [B, 1, S, kv]


def _mask_of(visible: torch.Tensor, impl: str, dtype: torch.dtype) -> torch.Tensor:
    """A boolean visibility (True = attend) as ``impl`` takes its mask: as it is for
    ``sdpa``, additive (0 / dtype min) for ``eager``, as HF uses."""
    if impl == "sdpa":
        return visible
    zero = torch.zeros((), dtype=dtype, device=visible.device)
    return torch.where(visible, zero, torch.finfo(dtype).min)


def position_masks(
    position_ids: torch.Tensor,
    kv_len,
    *,
    kinds,
    impl: str,
    window: int | None,
    dtype: torch.dtype,
) -> dict[str, torch.Tensor]:
    """:func:`position_mask` for each attention kind in ``kinds`` (the window applies to
    ``sliding_attention`` only): the ``masks`` input of a stage, built from positions."""
    return {
        kind: position_mask(
            position_ids,
            kv_len,
            impl=impl,
            window=window if kind == "sliding_attention" else None,
            dtype=dtype,
        )
        for kind in dict.fromkeys(kinds)
    }


def column_masks(
    columns: torch.Tensor,
    first: torch.Tensor,
    kv_len,
    *,
    kinds,
    impl: str,
    window: int | None,
    dtype: torch.dtype,
) -> dict[str, torch.Tensor]:
    """Masks [B, 1, S, kv_len] of a batch's ragged rows (``runtime.batch``): query ``(b, s)``
    sits in cache column ``columns[b, s]`` and sees the columns ``first[b] .. columns[b, s]``
    (its row's tokens up to its own; the row's left padding before ``first[b]`` hidden), and
    under a sliding window (``sliding_attention``) only those within it. A padding query
    (column before ``first[b]``) sees itself alone, so that no row of the softmax is empty:
    what it computes is never read. Built from tensors only (traces into compiled graphs)."""
    q = columns[:, :, None]  # [B, S, 1]
    k = torch.arange(kv_len, device=columns.device)[None, None, :]  # [1, 1, kv]
    visible = (k <= q) & ((k >= first[:, None, None]) | (k == q))
    out: dict[str, torch.Tensor] = {}
    for kind in dict.fromkeys(kinds):
        seen = visible
        if kind == "sliding_attention" and window is not None:
            seen = seen & (k > q - window)
        out[kind] = _mask_of(seen[:, None], impl, dtype)  # [B, 1, S, kv]
    return out


def row_masks(
    layout: AttentionLayout, starts: list[int], pads: list[int], n: int
) -> dict[str, torch.Tensor | None]:
    """Masks [B, 1, n, max(starts) + n] for n queries a row at columns starts[b].. of rows
    left-padded by pads[b]: row b's query at column c sees columns pads[b]..c (and, under a
    sliding window, those within the window). Aligned unpadded rows get the masks a single
    sequence gets (HF's own choice, None where SDPA's causal flag serves)."""
    if not any(pads) and min(starts) == max(starts):
        return masks_for(
            layout.impl, list(layout.kinds), starts[0], n, window=layout.window,
            dtype=layout.dtype, device=layout.device, additive=True,
        )  # fmt: skip
    device = layout.device
    end = max(starts) + n
    cols = torch.arange(end, device=device)[None, None, :]  # [1, 1, E]
    q = (torch.tensor(starts, device=device)[:, None] + torch.arange(n, device=device))[:, :, None]
    first = torch.tensor(pads, device=device)[:, None, None]  # [B, 1, 1]
    visible = (cols <= q) & (cols >= first)  # [B, n, E]
    blocked = float("-inf") if layout.impl == "sdpa" else torch.finfo(layout.dtype).min
    zero = torch.zeros((), dtype=layout.dtype, device=device)
    out: dict[str, torch.Tensor | None] = {}
    for kind in dict.fromkeys(layout.kinds):
        seen = visible
        if kind == "sliding_attention" and layout.window is not None:
            seen = visible & (cols > q - layout.window)
        out[kind] = torch.where(seen[:, None], zero, blocked)
    return out
