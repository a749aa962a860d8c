"""InsertExitHead: an early exit after the first E decoder layers (LayerSkip sec. 4.2).

The exit reuses the model's own final norm and LM head (LayerSkip trains every layer to exit
through them), so the pass adds no parameters: two ``call_module`` nodes that point at the same
modules as the final norm and head. The graph gains two outputs, ``exit_logits`` ([B, S, V]) and
``exit_hidden`` ([B, S, H], the residual stream after layer E-1, which the verify stage reuses
as the exit-query cache).

Example::

    >>> gm = InsertExitHead(layer=2).run(capture(hf_model)).graph_module
    >>> out = gm(input_ids, position_ids, masks, None)
    >>> sorted(out)
    ['exit_hidden', 'exit_logits', 'logits']
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from torch import fx

from .base import GraphPass, PassResult
from .capture import LAYER, ROLE, layer_node, nodes_by_role, output_dict, set_output_dict

EXIT_LAYER = "leapfx.exit_layer"


@dataclass(frozen=True)
class InsertExitHead(GraphPass):
    """Exit after the first ``layer`` decoder layers through the shared norm and LM head."""

    name: ClassVar[str] = "insert-exit-head"
    requires: ClassVar[frozenset[str]] = frozenset({"decoder-graph"})
    provides: ClassVar[frozenset[str]] = frozenset({"exit-head"})

    layer: int

    def run(self, gm: fx.GraphModule) -> PassResult:
        num_layers = len(nodes_by_role(gm, "layer"))
        if not 1 <= self.layer <= num_layers - 1:
            raise ValueError(
                f"exit_layer: {self.layer} is out of range for a {num_layers}-layer model; "
                f"allowed: 1..{num_layers - 1}"
            )
        existing = nodes_by_role(gm, "exit_head")
        if any(n.meta.get(EXIT_LAYER) == self.layer for n in existing):
            return PassResult(gm, modified=False, matches=0)  # already there: nothing to match
        if existing:
            raise ValueError(
                f"exit_layer: the graph already exits at layer {existing[0].meta[EXIT_LAYER]}; "
                "a second exit head is not supported"
            )
        source = layer_node(gm, self.layer - 1)
        assert source is not None, "capture annotates every decoder layer"
        norm_target = nodes_by_role(gm, "norm")[0].target
        head_target = nodes_by_role(gm, "head")[0].target
        with gm.graph.inserting_after(source):
            exit_norm = gm.graph.call_module(norm_target, (source,))
        with gm.graph.inserting_after(exit_norm):
            exit_logits = gm.graph.call_module(head_target, (exit_norm,))
        exit_norm.name = "exit_norm"
        exit_logits.name = "exit_logits"
        for node, role in ((exit_norm, "exit_norm"), (exit_logits, "exit_head")):
            node.meta[ROLE] = role
            node.meta[EXIT_LAYER] = self.layer
        source.meta["leapfx.exit_source"] = True
        outputs = dict(output_dict(gm))
        outputs.update(exit_logits=exit_logits, exit_hidden=source)
        set_output_dict(gm, outputs)
        gm.meta[EXIT_LAYER] = self.layer
        return PassResult(gm, modified=True, matches=1)


def exit_layer_of(gm: fx.GraphModule) -> int:
    """The exit layer E of a graph rewritten by InsertExitHead."""
    if EXIT_LAYER not in gm.meta:
        raise ValueError("graph has no exit head; run InsertExitHead first")
    return gm.meta[EXIT_LAYER]


def lower_layers(gm: fx.GraphModule) -> list[fx.Node]:
    """Layer nodes that run before the exit (index < E)."""
    e = exit_layer_of(gm)
    return [n for n in nodes_by_role(gm, "layer") if n.meta[LAYER] < e]
