"""build_offload: the expert-offload runtime of a graph the ``offload-experts`` pass rewrote.

The pass (``leapfx.passes.offload``) only rewrites the graph: its ``experts`` nodes call
unbound ``OffloadedExperts`` modules, its prefetch nodes unbound ``NextGatePrefetch`` /
``M2R2Prefetcher`` modules. This builds the one ``ExpertOffload`` of the model from the HF
experts modules those ``OffloadedExperts`` hold (slot pools, the slow tier: a file on disk or a
host copy, the transfer engine and its threads) and binds it to every ``OffloadModule`` in the
graph. ``rewrite.apply(..., offload=OffloadOptions(...))`` calls it after the recipe's passes and
hands the runtime to the ``SpeculativeModel`` (``sm.offload``).

Example::

    >>> gm = PassPipeline([OffloadExperts(prefetch="next_gate")])(capture(moe_model))
    >>> runtime = build_offload(gm, OffloadOptions(slots=0.5, prefetch="next_gate"))
    >>> runtime.num_slots, runtime.top_k
    (4, 2)
"""

from __future__ import annotations

from torch import fx

from ..modules.moe import OffloadedExperts, OffloadModule
from ..passes.offload import nodes_by_layer
from .runtime import ExpertOffload, OffloadOptions


def build_offload(gm: fx.GraphModule, options: OffloadOptions) -> ExpertOffload:
    """The ExpertOffload for ``gm``'s offloaded experts, bound to the graph's offload modules.

    ``options.prefetch`` must be what the pass inserted nodes for (``rewrite.apply`` passes
    both the same options). ValueError where the pass has not run on ``gm``.
    """
    experts = {i: gm.get_submodule(n.target) for i, n in nodes_by_layer(gm, "experts").items()}
    if not experts or not all(isinstance(m, OffloadedExperts) for m in experts.values()):
        raise ValueError(
            "gm: its experts nodes are not offloaded; allowed: a graph the offload-experts "
            "pass rewrote (leapfx.passes.offload.OffloadExperts, run by rewrite.apply(..., "
            "offload=...))"
        )
    routers = nodes_by_layer(gm, "router")
    top_k = gm.get_submodule(routers[min(routers)].target).top_k
    runtime = ExpertOffload({i: m.experts for i, m in experts.items()}, options, top_k=top_k)
    for module in gm.modules():
        if isinstance(module, OffloadModule):
            module.bind(runtime)
    return runtime
