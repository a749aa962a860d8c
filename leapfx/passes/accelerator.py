"""InsertAccelerator: M2R2's accelerated residual stream as branch nodes beside the slow layers.

M2R2 (sec. 2.2, eq. 1, 2, 4) runs a second, "fast" residual stream through the same layer
indices as the model's own; gates ``0 = E_0 < E_1 < ... < E_J`` cut the layers into intervals
(``leapfx.modules.m2r2`` holds the modules and their math: ``AcceleratedLayer``, the ARLA
router, ``Accelerator``). The pass inserts one fast node per layer of an interval.

Graph after the pass (for gates (2,) on a 4-layer model)::

    embed -> layer_0 -> layer_1 -> layer_2 -> layer_3 -> norm -> logits
       \\         |         |
        +----> fast_0 -> fast_1 -> gate_norm_2 -> gate_logits_2       (role "accelerator")

and the graph gains outputs ``gate_logits_{E}`` and ``gate_hidden_{E}`` per gate. The modules
live in an ``Accelerator`` the rewritten GraphModule owns (``gm.m2r2_accelerator``); its
state dict holds only the trainable parts, the host's weights stay shared by reference.

Example::

    >>> gm = InsertAccelerator(gates=(2,)).run(capture(hf_model)).graph_module
    >>> sorted(gm(input_ids, position_ids, masks, cache))
    ['gate_hidden_2', 'gate_logits_2', 'logits']
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from torch import fx

from ..modules.m2r2 import AcceleratedLayer, Accelerator, ARLARouter, default_heads
from ..options import check_int, is_int
from .base import GraphPass, PassResult, owned
from .capture import (
    ATTN_KIND,
    LAYER,
    ROLE,
    layer_module,
    layer_node,
    nodes_by_role,
    output_dict,
    set_output_dict,
)

ACCELERATOR_MODULE = "m2r2_accelerator"  # attribute of the rewritten GraphModule
GATE = "leapfx.gate"  # node.meta of a fast node: the gate E_{j+1} its interval ends at
GATES = "leapfx.gates"  # GraphModule meta: the gates (E_1..E_J)


def accelerator_of(gm: fx.GraphModule) -> Accelerator:
    """The Accelerator a graph rewritten by InsertAccelerator owns."""
    return owned(gm, ACCELERATOR_MODULE, Accelerator, "M2R2 accelerator", "InsertAccelerator")


def check_gates(gates, num_layers: int) -> tuple[int, ...]:
    """Gates E_1 < ... < E_J, each in 1..N-1; ValueError naming ``gates`` otherwise."""
    ok = isinstance(gates, (tuple, list)) and len(gates) >= 1
    ok = ok and all(is_int(g) for g in gates)
    ok = ok and all(1 <= g <= num_layers - 1 for g in gates)
    ok = ok and all(a < b for a, b in zip(gates, gates[1:], strict=False))
    if not ok:
        raise ValueError(
            f"gates: {gates!r} is invalid for a {num_layers}-layer model; allowed: a strictly "
            f"increasing sequence of integers in 1..{num_layers - 1}"
        )
    return tuple(gates)


@dataclass(frozen=True)
class InsertAccelerator(GraphPass):
    """Insert the fast residual stream for ``gates`` beside the slow layers (see module doc)."""

    name: ClassVar[str] = "insert-accelerator"
    requires: ClassVar[frozenset[str]] = frozenset({"decoder-graph"})
    provides: ClassVar[frozenset[str]] = frozenset({"m2r2-accelerator"})

    gates: tuple[int, ...]
    heads: int | None = None  # query heads of the fast attention; None: default_heads
    rank: int = 8
    routers: bool = False  # an ARLA router per gate (outputs gate_score_{E})
    # drafting reads only this many slow keys per layer and KV head (sec. 2.5); None: all
    fast_keys: int | None = None

    def run(self, gm: fx.GraphModule) -> PassResult:
        layers = nodes_by_role(gm, "layer")
        n = len(layers)
        gates = check_gates(self.gates, n)
        if nodes_by_role(gm, "accelerator"):
            raise ValueError("gates: the graph already has an accelerated stream")
        # layer_module, not the node's target: an MoE layer's node is its residual add.
        first = layer_module(gm, 0)
        if not hasattr(first, "self_attn") or not hasattr(first, "post_attention_layernorm"):
            raise ValueError(
                f"layer 0 is a {type(first).__name__}, not a HF decoder layer; run "
                "insert-accelerator before passes that replace decoder layers"
            )
        config = first.self_attn.config
        nh = config.num_attention_heads
        nkv = getattr(config, "num_key_value_heads", None) or nh
        heads = default_heads(nh, nkv) if self.heads is None else self.heads
        check_int("heads", heads, 1, nh)
        check_int("rank", self.rank, 1)
        k = check_int("fast_keys", self.fast_keys, 1, none=True)
        window = getattr(config, "sliding_window", None)
        modules = {}
        for i in range(gates[-1]):
            node = layer_node(gm, i)
            host = layer_module(gm, i)
            w = window if node.meta[ATTN_KIND] == "sliding_attention" else None
            modules[i] = AcceleratedLayer(
                host, index=i, heads=heads, rank=self.rank, window=w, fast_keys=k
            )
            modules[i].train(host.training)
        routers = None
        if self.routers:
            norm_module = gm.get_submodule(nodes_by_role(gm, "norm")[0].target)
            w = first.self_attn.o_proj.weight
            routers = {
                b: ARLARouter(norm_module, config.hidden_size, dtype=w.dtype, device=w.device)
                for b in gates
            }
        acc = Accelerator(modules, gates=gates, num_layers=n, routers=routers)
        gm.add_submodule(ACCELERATOR_MODULE, acc)

        g = gm.graph
        rope = nodes_by_role(gm, "rotary")[0]
        norm = nodes_by_role(gm, "norm")[0]
        head = nodes_by_role(gm, "head")[0]
        position_ids, cache = (
            next(x for x in g.nodes if x.op == "placeholder" and x.name == name)
            for name in ("position_ids", "cache")
        )
        embed = nodes_by_role(gm, "embed")[0]
        outputs = dict(output_dict(gm))
        edges = (0, *gates)
        for a, b in zip(edges, edges[1:], strict=False):
            p = embed if a == 0 else layer_node(gm, a - 1)  # the reset: p^{E_j} = h^{E_j}
            states = [p]
            for i in range(a, b):
                with g.inserting_after(layer_node(gm, i)):
                    p = g.call_module(
                        f"{ACCELERATOR_MODULE}.layers.{i}", (p, rope, position_ids, cache)
                    )
                p.name = f"fast_{i}"
                p.meta.update({ROLE: "accelerator", LAYER: i, GATE: b})
                states.append(p)
            if self.routers:
                with g.inserting_after(p):
                    score = g.call_module(f"{ACCELERATOR_MODULE}.routers.{b}", (states,))
                score.name = f"gate_score_{b}"
                score.meta.update({ROLE: "router", GATE: b})
                outputs[f"gate_score_{b}"] = score
            with g.inserting_after(p):
                normed = g.call_module(norm.target, (p,))
            with g.inserting_after(normed):
                logits = g.call_module(head.target, (normed,))
            normed.name, logits.name = f"gate_norm_{b}", f"gate_logits_{b}"
            normed.meta.update({ROLE: "gate_norm", GATE: b})
            logits.meta.update({ROLE: "gate_head", GATE: b})
            outputs[f"gate_logits_{b}"] = logits
            outputs[f"gate_hidden_{b}"] = p
        set_output_dict(gm, outputs)
        gm.meta[GATES] = gates
        return PassResult(gm, modified=True, matches=len(modules))


def compatible_layers(
    saved_gates, saved_layers: int, gates: tuple[int, ...], num_layers: int
) -> list[int]:
    """Fast layers of ``gates`` trained identically under ``saved_gates`` (same reset, same
    rate): a checkpoint trained for M2R2's exit gates (N/4, N/2, 3N/4) also serves the
    self-speculation recipe's single gate N/4."""
    if saved_layers != num_layers:
        return []
    ours = {i: (a, b) for a, b in zip((0, *gates), gates, strict=False) for i in range(a, b)}
    saved_gates = tuple(saved_gates)
    theirs = {
        i: (a, b) for a, b in zip((0, *saved_gates), saved_gates, strict=False) for i in range(a, b)
    }
    return [i for i in sorted(ours) if theirs.get(i) == ours[i]]
