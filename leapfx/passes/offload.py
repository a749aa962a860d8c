"""OffloadExperts: run every MoE layer's experts from an expert-offload runtime.

Capture gives each MoE layer an ``experts`` node (``experts(hidden, top_k_index,
top_k_weights)``) and a ``router`` node. This pass points each ``experts`` node at an
``OffloadedExperts`` module and, for ``prefetch="next_gate"``, inserts after layer i's
``experts`` node a ``prefetch`` node that applies the next MoE layer's norm and router to layer
i's post-attention residual and starts loading what they pick. The prefetch node is marked as a
side effect, so every stage that runs layer i keeps it. Orthogonal to recipes: it runs after
their passes, on whatever stages they cut.

The pass only rewrites the graph. The modules it inserts (``leapfx.modules.moe``) are
unbound: the runtime they call into (one ``ExpertOffload`` for the model: slot pools, the slow
tier's file or host copy, transfer threads) is built from the rewritten graph by
``leapfx.offload.build_offload``, which binds it to them; ``rewrite.apply(...,
offload=OffloadOptions(...))`` runs the pass, then the builder, and hands the runtime to the
``SpeculativeModel``. Nothing here opens a file or starts a thread.

``prefetch="m2r2"`` (M2R2 sec. 2.3.3) adds a fast residual stream at rate 2: the accelerated
layers of ``passes.accelerator`` for gate N/2 (trained parts from ``m2r2_parts``), whose state
p^{i+1} ~ h^{2i+2} after fast layer i predicts MoE layers 2i+2 and 2i+3
(``modules.moe.predicted_layers``; layers 0 and 1 are never predicted). Fast layer i of
token t reads slow layer i's keys of positions < t only, all cached before the slow pass of t
starts, so one node right after the embedding and the rotary (before slow layer 0) runs the
whole stream up front and makes every prediction at once: ``modules.moe.M2R2Prefetcher``
(with the CPU kernels on, one ``leapfx_cpu::m2r2_predict`` call a decode step). The runtime
starts the loads of layer L once layer L - ``OffloadOptions.prefetch_lead`` (3) has placed its
own experts, so that they do not queue ahead of the early layers' on-demand reads (None: all at
the step's start). A prefill predicts nothing. Only for recipes without draft layers
(``autoregressive``): a fast stream that crosses a draft/verify cut would have to be carried
between stages.

``prefetch="verify_union"`` (speculative recipes: an exit layer E) adds, after layer E-1, one
prefetch node per MoE layer L >= E that routes the exit state h^E through L's norm and router,
adding to the union of the round: every draft, and the last draft's lower pass inside verify,
contributes its token, so when the verify pass runs layers >= E over the round's d + 1 tokens
their experts are (predicted to be) in place.

Example::

    >>> gm = OffloadExperts(prefetch="next_gate").run(capture(moe_model)).graph_module
    >>> [n.target for n in nodes_by_role(gm, "experts")][:1]
    ['leapfx_offload.experts_0']
    >>> runtime = build_offload(gm, OffloadOptions(slots=0.5))  # leapfx.offload
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import ClassVar

from torch import fx

from ..modules.m2r2 import AcceleratedLayer, Accelerator, default_heads
from ..modules.moe import M2R2Prefetcher, NextGatePrefetch, OffloadedExperts, predicted_layers
from ..parts.m2r2 import read_parts_config
from .accelerator import ACCELERATOR_MODULE
from .base import GraphPass, PassResult
from .capture import ATTN_KIND, LAYER, ROLE, SIDE_EFFECT, layer_module, layer_node, nodes_by_role
from .exit_head import EXIT_LAYER
from .load_parts import LoadAccelerator

# "m2r2": M2R2's accelerated residual at rate 2, fast layer i predicting layers 2i+2, 2i+3,
# the whole stream run before the slow pass (``modules.moe.M2R2Prefetcher``); "verify_union":
# for speculative recipes, the union of the upper layers' experts that the drafts' exit states
# route to (``NextGatePrefetch(union=True)``).
PREFETCH_POLICIES = ("none", "next_gate", "m2r2", "verify_union")
M2R2_STREAM = "leapfx_offload.m2r2_stream"  # the m2r2 policy's M2R2Prefetcher
PREFETCH_LAYERS = "leapfx.prefetch_layers"  # node.meta of its node: the MoE layers it predicts


def nodes_by_layer(gm: fx.GraphModule, role: str) -> dict[int, fx.Node]:
    """The decoder layers' nodes of ``role`` by layer (M2R2's ARLA gate routers, also
    ``router`` nodes, belong to no decoder layer)."""
    return {n.meta[LAYER]: n for n in nodes_by_role(gm, role) if LAYER in n.meta}


@dataclass(frozen=True)
class OffloadExperts(GraphPass):
    """Point the experts of every MoE layer at an ``OffloadedExperts`` (bound later to the
    runtime) and insert the prefetch nodes of ``prefetch`` (one of PREFETCH_POLICIES);
    ``m2r2_parts``: the trained fast stream of ``prefetch="m2r2"`` (None: untrained)."""

    name: ClassVar[str] = "offload-experts"
    requires: ClassVar[frozenset[str]] = frozenset({"decoder-graph"})
    provides: ClassVar[frozenset[str]] = frozenset({"offloaded-experts"})

    prefetch: str = "none"
    m2r2_parts: str | os.PathLike | None = None

    def run(self, gm: fx.GraphModule) -> PassResult:
        if self.prefetch not in PREFETCH_POLICIES:
            raise ValueError(
                f"prefetch: {self.prefetch!r} is invalid; allowed: "
                f"{', '.join(map(repr, PREFETCH_POLICIES))}"
            )
        experts = nodes_by_layer(gm, "experts")
        if not experts:
            raise ValueError(
                "offload: the model has no MoE layers (no experts nodes); allowed: an MoE "
                "model (mixtral, qwen2_moe, qwen3_moe, olmoe)"
            )
        modules = {i: gm.get_submodule(n.target) for i, n in experts.items()}
        if any(isinstance(m, OffloadedExperts) for m in modules.values()):
            return PassResult(gm, modified=False, matches=0)  # offloaded already
        for i, node in experts.items():
            target = f"leapfx_offload.experts_{i}"
            gm.add_submodule(target, OffloadedExperts(None, i, modules[i]))
            node.target = target
        prefetch = self.prefetch
        if prefetch == "next_gate":
            residuals = nodes_by_layer(gm, "attn_residual")
            layers = sorted(experts)
            for i, j in zip(layers, layers[1:], strict=False):
                _prefetch_node(gm, experts[i], residuals[i], i, j)
        elif prefetch == "m2r2":
            _m2r2_stream(gm, self.m2r2_parts, set(experts))
        elif prefetch == "verify_union":
            if EXIT_LAYER not in gm.meta:
                raise ValueError(
                    "prefetch: 'verify_union' prefetches for the verify pass of a speculative "
                    "recipe; allowed with recipes that draft with layers < E (layerskip, "
                    "kangaroo), or prefetch='none'/'next_gate'/'m2r2'"
                )
            e = gm.meta[EXIT_LAYER]
            exit_state = after = layer_node(gm, e - 1)
            for j in sorted(x for x in experts if x >= e):
                after = _prefetch_node(gm, after, exit_state, e - 1, j, union=True)
        return PassResult(gm, modified=True, matches=len(experts))


def _prefetch_node(
    gm: fx.GraphModule, after: fx.Node, hidden: fx.Node, layer: int, target: int, *,
    union: bool = False,
) -> fx.Node:  # fmt: skip
    """Insert after ``after`` a side-effect node of ``layer`` that routes ``hidden`` through
    MoE layer ``target``'s norm and router and prefetches what they pick."""
    name = f"leapfx_offload.prefetch_{layer}_{target}"
    norm = gm.get_submodule(nodes_by_layer(gm, "moe_norm")[target].target)
    router = gm.get_submodule(nodes_by_layer(gm, "router")[target].target)
    gm.add_submodule(name, NextGatePrefetch(None, target, norm, router, union=union))
    with gm.graph.inserting_after(after):
        node = gm.graph.call_module(name, (hidden,))
    node.name = f"layer_{layer}_prefetch_{target}"
    node.meta.update({ROLE: "prefetch", LAYER: layer, SIDE_EFFECT: True,
                      "leapfx.prefetch_layer": target})  # fmt: skip
    return node


def _m2r2_stream(gm: fx.GraphModule, parts, moe: set[int]) -> None:
    """The rate-2 fast stream and its predictions as one prefetch node before slow layer 0 (see
    the module docstring)."""
    if EXIT_LAYER in gm.meta or hasattr(gm, ACCELERATOR_MODULE):
        raise ValueError(
            "prefetch: 'm2r2' runs its own fast stream beside the full model; allowed with "
            "the autoregressive recipe (speculative recipes: prefetch='verify_union')"
        )
    n = gm.meta["leapfx.num_layers"]
    gate = n // 2
    options = read_parts_config(parts).get("options", {}) if parts is not None else {}
    if parts is not None and (options.get("gates") or [None])[0] != gate:
        raise ValueError(
            f"m2r2_parts: {str(parts)!r} were trained with gates {options.get('gates')}; the "
            f"m2r2 prefetch policy needs a rate-2 stream, gate N/2 = {gate} (`leapfx train-m2r2 "
            f"--fast-layers {gate}`)"
        )
    config = layer_module(gm, 0).self_attn.config
    nkv = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    heads = options.get("heads") or default_heads(config.num_attention_heads, nkv)
    window = getattr(config, "sliding_window", None)
    fast = {}
    for i in range(gate):
        w = window if layer_node(gm, i).meta[ATTN_KIND] == "sliding_attention" else None
        fast[i] = AcceleratedLayer(layer_module(gm, i), index=i, heads=heads,
                                   rank=options.get("rank", 8), window=w).eval()  # fmt: skip
    gm.add_submodule(ACCELERATOR_MODULE, Accelerator(fast, gates=(gate,), num_layers=n))
    if parts is not None:
        LoadAccelerator(str(parts)).run(gm)
    rope = nodes_by_role(gm, "rotary")[0]
    targets = {i: [t for t in predicted_layers(i, n) if t in moe] for i in range(gate)}
    last = max((i for i, t in targets.items() if t), default=-1)
    predictors = []  # (fast layer, its prediction for MoE layer t), t = 2, 3, 4, ...
    for i in range(last + 1):
        for t in targets[i]:
            norm = gm.get_submodule(nodes_by_layer(gm, "moe_norm")[t].target)
            router = gm.get_submodule(nodes_by_layer(gm, "router")[t].target)
            predictors.append((i, NextGatePrefetch(None, t, norm, router)))
    acc = gm.get_submodule(ACCELERATOR_MODULE)  # every fast layer up to the last predicting
    layers = [acc.layers[str(i)] for i in range(last + 1)]
    stream = M2R2Prefetcher(None, layers, predictors, gm.get_submodule(rope.target))
    gm.add_submodule(M2R2_STREAM, stream)
    g = gm.graph
    position_ids, cache = (
        next(x for x in g.nodes if x.op == "placeholder" and x.name == placeholder)
        for placeholder in ("position_ids", "cache")
    )
    embed = nodes_by_role(gm, "embed")[0]  # the reset p^0 = h^0
    # Before slow layer 0: fast layer i reads slow layer i's keys < t, all cached by then.
    with g.inserting_after(rope):
        node = g.call_module(M2R2_STREAM, (embed, rope, position_ids, cache))
    node.name = "m2r2_prefetch"
    node.meta.update({ROLE: "prefetch", SIDE_EFFECT: True, PREFETCH_LAYERS: stream.targets})
