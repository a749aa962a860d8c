"""M2R2's scratch: the fast keys/values a drafting round or a training chain carries.

The fast stream (``leapfx.modules.m2r2``) writes nothing into the shared KV cache: the keys and
values its layers compute for positions the slow stream has not verified live here, one record
per round, and are dropped after verification.

- :class:`FastScratch`: a drafting round's, in Python lists (eager and kernel drafts; the
  ``leapfx_cpu::m2r2_draft`` op's packed copy; an exported draft's returned choice of slots);
- :class:`FastState`: the same as tensors passed in and taken back, for a draft stage traced to
  a graph (the ONNX export's ``draft``);
- :class:`ChainScratch`: training's unrolled draft chain, every position at once.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class FastScratch:
    """Temporary fast keys/values of a drafting round: cache layer -> [(k, v)] ([B, h_kv, 1, D]
    each).

    They belong to draft positions the slow stream has not verified; the schedule makes a new
    scratch every round, so they are discarded after verification (the shared cache is never
    written by the fast stream)."""

    kv: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = field(default_factory=dict)
    # cache layer -> (positions [B, h_kv, k], their keys, their values [B, h_kv, k, D]): the
    # slow keys a ``fast_keys`` layer reads this round, chosen and gathered once at the round's
    # first draft (sec. 2.5's top-k keys; the slow cache does not change within a round)
    top: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    # the same fast keys/values packed for ``leapfx_cpu::m2r2_draft`` ([L, 2, m, h_kv, D]; see
    # ``modules.m2r2_kernels.KernelDraft``), None until the op drafts
    packed: torch.Tensor | None = None
    # what an exported draft stage returns beside the fast keys, by the input it feeds next
    # (``fast_keys``' choice of slots, ``fast_past.{i}.top``: ``lower.ort_stages.OrtFastDraft``)
    exported: dict[str, torch.Tensor] = field(default_factory=dict)

    def __len__(self) -> int:
        return max((len(v) for v in self.kv.values()), default=0)


@dataclass
class FastState:
    """A drafting round's scratch as tensors that the caller passes in and takes back: what
    :class:`FastScratch` holds in Python lists, for a draft stage traced to a graph (the ONNX
    export's ``draft``, ``leapfx.export.fast_draft``), one row per sequence.

    ``slow``: cache layer -> its whole key/value buffers [B, H_kv, max_len, D] (slot j holds
    position j), read in place; ``past``: cache layer -> the round's earlier drafts' fast
    keys/values [B, h_kv, m, D] (m = 0 at the round's first draft); ``present``: filled by the
    layers, ``past`` with this draft's own key/value appended [B, h_kv, m + 1, D], the next
    draft's ``past``. A draft at position t is the round's (m+1)-th, so the round started at
    t - m: the slow slots from there on hold no verified key (stale ones of rejected drafts,
    or nothing) and are masked, which is the eager path's ``cache.lengths`` in a graph. A
    ``fast_keys`` layer also reads and returns the round's choice of slow slots (``top``,
    ``top_present``: :meth:`.m2r2.AcceleratedLayer._traced_top_keys`), ``FastScratch.top``'s
    positions."""

    slow: dict[int, tuple[torch.Tensor, torch.Tensor]]
    past: dict[int, tuple[torch.Tensor, torch.Tensor]]
    present: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    # ``fast_keys`` layers: cache layer -> the round's choice of slow slots [B, h_kv, k]
    # (int64; anything at the round's first draft, which chooses), and the choice returned
    top: dict[int, torch.Tensor] = field(default_factory=dict)
    top_present: dict[int, torch.Tensor] = field(default_factory=dict)


@dataclass
class ChainScratch:
    """Training's unrolled draft chain (the "training-time test" of EAGLE-3 / HASS): the fast
    keys/values of every earlier chain step, all positions at once: cache layer -> [(k, v)]
    ([B, h_kv, S, D] each, with autograd), one entry per step already run.

    Drafting reads what training with teacher-forced slow keys never shows: draft j of a round
    that starts at position s sits at s + j and attends to the slow keys of positions < s and
    the fast keys of the round's earlier drafts at s..s+j-1. Step j of the chain runs every
    position t as draft j of the round starting at t - j, so row t sees slow columns < t - j,
    step m's fast column t - j + m (m < j) and its own: the mask drafting has, in one
    parallel pass per step."""

    kv: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = field(default_factory=dict)

    def __len__(self) -> int:
        return max((len(v) for v in self.kv.values()), default=0)
