"""Inductor for SpecEE: the per-layer segments and exit checks its schedule calls, compiled.

The SpecEE schedule (``leapfx.runtime.specee``) calls one stage per decoder layer, one per
exit check and a head, each with Python-int cache lengths and a mask built on the host. A
compiled segment cannot take those (every new length would be a recompile), so, as
``inductor.py`` does for whole stages:

- a layer segment writes its K/V at the positions given as a tensor (``SlotKVCache``) and
  builds its mask in the graph from those positions over every ``max_len`` slot; the per-layer
  validity bias of ``kv_fill="mask"`` (0 / -inf per slot, ``SpecEEDecoder.bias``) comes in as
  one more input and hides the slots the exited tokens left empty (``kv_fill="next"`` and
  verified positions pass zeros);
- exit checks, the head and the rotary stage stay eager (see ``specee_segments``; with the
  CPU kernels each check is one ``leapfx_cpu::exit_check`` call);
- ``draft`` and ``full`` are ordinary stages (``CompiledStage``).

``compile()`` warms every shape up, so decoding never compiles (a test runs it under
``torch._dynamo.config.error_on_recompile``).
"""

from __future__ import annotations

import torch

from ..runtime.masks import position_mask
from .inductor import inductor_options, own_code
from .pure_stage import SlotKVCache

# Stages of the specee cut that are not whole-model stages (``passes.specee_stages``).
SEGMENT_PREFIXES = ("layer_", "check_", "probs_")
SEGMENT_NAMES = ("rope", "head")


def is_segment(name: str) -> bool:
    return name.startswith(SEGMENT_PREFIXES) or name in SEGMENT_NAMES


class _PureLayer(torch.nn.Module):
    """A ``layer_i`` stage as a function of tensors (the cache buffers first)."""

    def __init__(self, stage, layer: int, kind: str, layout) -> None:
        super().__init__()
        self.stage = stage
        self.layer = layer
        self.window = layout.window if kind == "sliding_attention" else None
        self.layout = layout

    def forward(self, keys, values, hidden, cos, sin, position_ids, bias):
        lay = self.layout
        max_len = keys[0].shape[2]
        mask = position_mask(position_ids, max_len, impl=lay.impl, window=self.window,
                             dtype=lay.dtype)  # fmt: skip
        valid = (bias == 0)[None, None, None, :]  # [1, 1, 1, max_len]
        if lay.impl == "sdpa":
            mask = mask & valid
        else:
            mask = torch.where(valid, mask, torch.finfo(lay.dtype).min)
        cache = SlotKVCache(keys, values, {self.layer: position_ids[0]})
        out = self.stage(hidden=hidden, rope=(cos, sin), mask=mask, position_ids=position_ids,
                         cache=cache)  # fmt: skip
        return out["hidden"]


def _compiled_pair(fn, name: str, options: dict):
    """(one-row callable, dynamic-rows callable) of ``fn``, each with its own dynamo cache."""
    step = torch.compile(own_code(fn, f"{name}_step"), fullgraph=True, dynamic=False,
                         options=dict(options))  # fmt: skip
    chunk = torch.compile(own_code(fn, f"{name}_chunk"), fullgraph=True, options=dict(options))
    return step, chunk


def _contiguous(t: torch.Tensor) -> torch.Tensor:
    # Dynamo guards on strides and on inference-ness: a fresh contiguous copy looks the same
    # at every call (as CompiledStage._run does).
    return t.clone(memory_format=torch.contiguous_format)


def _rows(fns, args: list, by_row: list[torch.Tensor]):
    """The one-row graph, or the dynamic one with dim 1 of ``by_row`` (the row inputs) marked."""
    step, chunk = fns
    if by_row[0].shape[1] == 1:
        return step(*args)
    for t in by_row:
        torch._dynamo.maybe_mark_dynamic(t, 1)
    return chunk(*args)


class LayerSegment:
    """Executor of ``layer_i``: called as the eager stage, plus ``bias`` (None: all valid)."""

    builds_masks = True

    def __init__(self, name: str, pure: _PureLayer, options: dict) -> None:
        self.name, self.pure, self.layer = name, pure, pure.layer
        self.fns = _compiled_pair(pure, name, options)
        self._zeros: torch.Tensor | None = None

    def __call__(self, *, hidden, rope, mask, position_ids, cache, bias=None):
        del mask  # built in the graph from the positions (and the bias)
        n = hidden.shape[1]
        ends = cache.reserve({self.layer: n})
        if bias is None:
            if self._zeros is None or self._zeros.shape[0] != cache.max_len:
                self._zeros = hidden.new_zeros(cache.max_len)
            bias = self._zeros
        cos, sin = rope
        args = [_contiguous(t) for t in (hidden, cos, sin, position_ids, bias)]
        out = _rows(self.fns, [cache.keys, cache.values, *args], args[:4])
        cache.advance(ends)
        return {"hidden": out}


def specee_segments(sm, stages: dict, options, device) -> dict:
    """A compiled executor for every ``layer_i`` of ``stages`` (SpecEE's cut); the cache-free
    stages (exit checks, head, rotary) stay eager: they hold no cache and no mask, so they
    compile as they are, but that is not measured yet. The exit checks are ``stages``' own
    (with the CPU kernels: one ``leapfx_cpu::exit_check`` call each), the head and rotary the
    model's untransposed ones."""
    opts = inductor_options(options, device)
    lay = sm._layout
    out = {}
    for name, stage in stages.items():
        if name.startswith("layer_"):
            layer = int(name.split("_")[1])
            pure = _PureLayer(stage, layer, lay.kinds[layer], lay)
            out[name] = LayerSegment(name, pure, opts)
        elif name.startswith(("check_", "probs_")):
            out[name] = stage  # eager
        else:
            out[name] = sm.stages.modules[name]  # eager, untransposed
    return out


def warmup_segments(segments: dict, cache, hidden_size: int, dtype, device) -> None:
    """Run every compiled layer segment at one row and at two and three (the dynamic graph)."""
    for seg in segments.values():
        if not isinstance(seg, LayerSegment):
            continue
        for n in (1, 2, 3):
            h = torch.zeros(1, n, hidden_size, dtype=dtype, device=device)
            pos = torch.arange(n, device=device)[None]
            rope = segments["rope"](hidden=h, position_ids=pos)["rope"]
            cache.lengths[seg.layer] = 0
            seg(hidden=h, rope=rope, mask=None, position_ids=pos, cache=cache)
    cache.reset()
