"""OffloadExperts: run every MoE layer's experts from an expert-offload runtime.

Capture gives each MoE layer an ``experts`` node (``experts(hidden, top_k_index,
top_k_weights)``) and a ``router`` node. This pass builds one ``ExpertOffload`` for the model
(slot pools, slow tier, transfer engine; see ``leapfx.runtime.offload``), points each
``experts`` node at an ``OffloadedExperts`` module over it, and, for ``prefetch="next_gate"``,
inserts after layer i's ``experts`` node a ``prefetch`` node that applies the next MoE layer's
norm and router to layer i's post-attention residual and starts loading what they pick. The
prefetch node is marked as a side effect, so every stage that runs layer i keeps it. The
runtime lands in ``gm.meta["leapfx.offload"]``. Orthogonal to recipes: it runs after their
passes, on whatever stages they cut.

Example::

    >>> gm = OffloadExperts(OffloadOptions(slots=0.5)).run(capture(moe_model)).graph_module
    >>> [n.target for n in nodes_by_role(gm, "experts")][:1]
    ['leapfx_offload.experts_0']
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from torch import fx

from ..runtime.offload import ExpertOffload, NextGatePrefetch, OffloadedExperts, OffloadOptions
from .base import GraphPass, PassResult
from .capture import LAYER, ROLE, SIDE_EFFECT, nodes_by_role

OFFLOAD = "leapfx.offload"


def _by_layer(gm: fx.GraphModule, role: str) -> dict[int, fx.Node]:
    return {n.meta[LAYER]: n for n in nodes_by_role(gm, role)}


@dataclass(frozen=True)
class OffloadExperts(GraphPass):
    """Run the experts of every MoE layer from the fast tier of an ExpertOffload."""

    name: ClassVar[str] = "offload-experts"
    requires: ClassVar[frozenset[str]] = frozenset({"decoder-graph"})
    provides: ClassVar[frozenset[str]] = frozenset({"offloaded-experts"})

    options: OffloadOptions

    def run(self, gm: fx.GraphModule) -> PassResult:
        experts = _by_layer(gm, "experts")
        if not experts:
            raise ValueError(
                "offload: the model has no MoE layers (no experts nodes); allowed: an MoE "
                "model (mixtral, qwen2_moe, qwen3_moe, olmoe)"
            )
        if OFFLOAD in gm.meta:
            return PassResult(gm, modified=False, matches=0)
        routers = _by_layer(gm, "router")
        modules = {i: gm.get_submodule(n.target) for i, n in experts.items()}
        top_k = gm.get_submodule(routers[min(routers)].target).top_k
        runtime = ExpertOffload(modules, self.options, top_k=top_k)
        for i, node in experts.items():
            target = f"leapfx_offload.experts_{i}"
            gm.add_submodule(target, OffloadedExperts(runtime, i, modules[i]))
            node.target = target
        if self.options.prefetch == "next_gate":
            residuals, norms = _by_layer(gm, "attn_residual"), _by_layer(gm, "moe_norm")
            layers = sorted(experts)
            for i, j in zip(layers, layers[1:], strict=False):
                target = f"leapfx_offload.prefetch_{i}"
                module = NextGatePrefetch(
                    runtime, j, gm.get_submodule(norms[j].target),
                    gm.get_submodule(routers[j].target),
                )  # fmt: skip
                gm.add_submodule(target, module)
                with gm.graph.inserting_after(experts[i]):
                    node = gm.graph.call_module(target, (residuals[i],))
                node.name = f"layer_{i}_prefetch"
                node.meta.update({ROLE: "prefetch", LAYER: i, SIDE_EFFECT: True,
                                  "leapfx.prefetch_layer": j})  # fmt: skip
        gm.meta[OFFLOAD] = runtime
        return PassResult(gm, modified=True, matches=len(experts))
