"""FuseDecoderLayers: call each decoder layer's math directly, without nn.Module dispatch.

Points every fusable decoder-layer node at a ``FusedDecoderLayer`` and every MoE layer's
attention node at a ``FusedAttention`` over the same weights (``leapfx.modules.fused`` holds
the modules and says what they compute: bitwise HF's). Other layers (Phi-3's fused
projections) are left as they are; the match count says how many changed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from torch import fx, nn

from ..modules.fused import FUSABLE_ATTENTION, FusedAttention, FusedDecoderLayer, fusable
from ..modules.hf import CACHE_KWARG, rename_cache_kwarg
from .base import GraphPass, PassResult
from .capture import nodes_by_role


@dataclass(frozen=True)
class FuseDecoderLayers(GraphPass):
    """Point every fusable decoder-layer node at a FusedDecoderLayer over the same weights."""

    name: ClassVar[str] = "fuse-decoder-layers"
    requires: ClassVar[frozenset[str]] = frozenset({"decoder-graph"})
    provides: ClassVar[frozenset[str]] = frozenset({"fused-layers"})

    def run(self, gm: fx.GraphModule) -> PassResult:
        matches = 0
        for node in nodes_by_role(gm, "layer"):
            if node.op != "call_module":  # an MoE layer's residual add (see capture)
                continue
            layer = gm.get_submodule(node.target)
            if isinstance(layer, FusedDecoderLayer) or not fusable(layer):
                continue
            _run_on(gm, node, "layer", FusedDecoderLayer(layer))
            matches += 1
        for node in nodes_by_role(gm, "attention"):  # MoE layers' attention nodes
            attn = gm.get_submodule(node.target)
            if type(attn).__name__ not in FUSABLE_ATTENTION or attn.training:
                continue
            _run_on(gm, node, "attention", FusedAttention(attn))
            matches += 1
        return PassResult(gm, modified=matches > 0, matches=matches)


def _run_on(gm: fx.GraphModule, node: fx.Node, kind: str, module: nn.Module) -> None:
    """Point ``node`` at ``module``, registered as ``leapfx_fused.{kind}_{layer}``, with its
    cache keyword renamed to the fused modules' (``CACHE_KWARG``)."""
    target = f"leapfx_fused.{kind}_{node.meta['leapfx.layer']}"
    gm.add_submodule(target, module)
    node.target = target
    node.kwargs = rename_cache_kwarg(node.kwargs, CACHE_KWARG)
