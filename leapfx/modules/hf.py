"""What leapfx's modules need to know about HuggingFace's: the KV cache's keyword, an MoE
layer's expert tensors.

Capture (``leapfx.passes.capture``) builds graph nodes with these conventions and the modules a
pass inserts (``kangaroo``, ``eagle``, ``fused``) call HF modules by them, so they live here,
beneath both.
"""

from __future__ import annotations

import functools
import inspect

from torch import nn

# The keyword leapfx's own modules take the KV cache under, and graph nodes that call them pass.
CACHE_KWARG = "past_key_values"


def cache_kwarg(module: nn.Module) -> str:
    """The keyword under which ``module``'s ``forward`` takes the KV cache: ``"cache"`` for HF
    layers and attentions from transformers 5.24 on (which still accept the old name, with a
    FutureWarning, until 5.40), ``"past_key_values"`` before that and for leapfx's modules."""
    return _cache_kwarg(type(module))


@functools.cache
def _cache_kwarg(cls: type) -> str:
    try:  # follows __wrapped__: HF's deprecate_kwarg wrapper shows the function's own names
        names = inspect.signature(cls.forward).parameters
    except (TypeError, ValueError):
        return CACHE_KWARG
    if CACHE_KWARG not in names and "cache" in names:
        return "cache"
    return CACHE_KWARG


def rename_cache_kwarg(kwargs: dict, name: str) -> dict:
    """``kwargs`` (a node's) with the KV cache under ``name``, whichever name it had."""
    out = {k: v for k, v in kwargs.items() if k not in ("cache", CACHE_KWARG)}
    for key in ("cache", CACHE_KWARG):
        if key in kwargs:
            out[name] = kwargs[key]
    return out


# On an <X>Experts module whose weights stay in a checkpoint (leapfx.offload's
# load_offloaded): its (gate_up, down) sources beside the meta tensors.
EXPERT_SOURCE = "leapfx_expert_source"


def expert_tensors(module: nn.Module) -> tuple:
    """An ``<X>Experts`` module's (gate_up_proj, down_proj): its tensors, or the checkpoint
    sources ``load_offloaded`` left beside meta ones."""
    source = getattr(module, EXPERT_SOURCE, None)
    return source if source is not None else (module.gate_up_proj, module.down_proj)
