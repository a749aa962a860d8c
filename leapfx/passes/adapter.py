"""InsertKangarooAdapter: Kangaroo's self-draft model (sec. 3.1) as a graph rewrite.

The draft model is ``M^s = A o M^b[:l]``: the first ``l`` decoder layers of the host, then the
adapter ``A`` -- an input norm, ONE attention block of the host's own attention class (GQA as in
the host) with a residual connection around it, and a last norm (Table 2: "Input LN, Attention,
Last LN"; no FFN) -- then the host's OWN LM head (no new head). The residual follows the
authors' code (``h + attn(norm(h))``); the paper's text does not spell it out.

The adapter's modules live in a ``KangarooAdapter`` (``leapfx.modules.kangaroo``) that the
rewritten GraphModule owns (``gm.kangaroo_adapter``); nothing is added to the user's model, and
every host weight (layers, LM head) stays shared by reference. The adapter's attention has
its own layer in the shared KV cache: ``layer_idx = num_hidden_layers``, one past the host's
layers, so a crop rolls it back with the rest. The pass records that in
``gm.meta["leapfx.extra_cache_layers"]``.

Graph after the pass (nodes inserted right after layer l-1, roles ``adapter_*``)::

    layer_{l-1} -> adapter_input_norm -> adapter_attention -> adapter_attention_out (getitem 0)
                -> adapter_residual (layer_{l-1} + attention) -> adapter_norm -> adapter_logits
                   (lm_head, shared)

and the graph gains two outputs, like an exit head: ``exit_logits`` (the adapter's logits) and
``exit_hidden`` (layer l-1's output, the early feature the verify stage reuses). The attention
node is marked ``leapfx.writes_cache``, so a stage that runs the shallow layers keeps it (and
fills the adapter's cache layer) even where the adapter's output is not needed (prefill, verify).

Example::

    >>> gm = InsertKangarooAdapter(exit_layer=2).run(capture(hf_model)).graph_module
    >>> sorted(gm(input_ids, position_ids, masks, None))
    ['exit_hidden', 'exit_logits', 'logits']
    >>> sum(p.numel() for p in gm.kangaroo_adapter.parameters())  # two norms + one attention
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import ClassVar

from torch import fx

from ..modules.hf import cache_kwarg
from ..modules.kangaroo import KangarooAdapter
from .base import GraphPass, PassResult, owned
from .capture import (
    ATTN_KIND,
    EXTRA_CACHE_LAYERS,
    WRITES_CACHE,
    NodeChain,
    layer_module,
    layer_node,
    nodes_by_role,
    output_dict,
    set_output_dict,
)
from .exit_head import EXIT_LAYER

ADAPTER_MODULE = "kangaroo_adapter"  # attribute of the rewritten GraphModule
CACHE_LAYER = "leapfx.cache_layer"  # node.meta: the KV-cache layer index an attention writes


def adapter_of(gm: fx.GraphModule) -> KangarooAdapter:
    """The KangarooAdapter a graph rewritten by InsertKangarooAdapter owns."""
    return owned(gm, ADAPTER_MODULE, KangarooAdapter, "Kangaroo adapter", "InsertKangarooAdapter")


@dataclass(frozen=True)
class InsertKangarooAdapter(GraphPass):
    """Insert the Kangaroo adapter after the first ``exit_layer`` decoder layers."""

    name: ClassVar[str] = "insert-kangaroo-adapter"
    requires: ClassVar[frozenset[str]] = frozenset({"decoder-graph"})
    provides: ClassVar[frozenset[str]] = frozenset({"kangaroo-adapter"})

    exit_layer: int

    def run(self, gm: fx.GraphModule) -> PassResult:
        layers = nodes_by_role(gm, "layer")
        num_layers = len(layers)
        if not 1 <= self.exit_layer <= num_layers - 1:
            raise ValueError(
                f"exit_layer: {self.exit_layer} is out of range for a {num_layers}-layer model; "
                f"allowed: 1..{num_layers - 1}"
            )
        existing = nodes_by_role(gm, "adapter_attention")
        if existing:
            if existing[0].meta[EXIT_LAYER] == self.exit_layer:
                return PassResult(gm, modified=False, matches=0)  # already there
            raise ValueError(
                f"exit_layer: the graph already has a Kangaroo adapter after layer "
                f"{existing[0].meta[EXIT_LAYER]}; a second adapter is not supported"
            )
        if EXIT_LAYER in gm.meta or nodes_by_role(gm, "exit_head"):
            raise ValueError(
                "the graph already has an exit head; the Kangaroo adapter is the draft head "
                "and cannot be combined with another"
            )

        source = layer_node(gm, self.exit_layer - 1)
        target_layer = layer_node(gm, self.exit_layer)
        assert source is not None and target_layer is not None, "capture annotates every layer"
        kind = target_layer.meta[ATTN_KIND]
        norm = nodes_by_role(gm, "norm")[0]
        head = nodes_by_role(gm, "head")[0]
        host_layer = layer_module(gm, self.exit_layer)
        if not hasattr(host_layer, "self_attn") or not hasattr(host_layer, "input_layernorm"):
            raise ValueError(
                f"layer {self.exit_layer} is a {type(host_layer).__name__}, not a HF decoder "
                "layer; run insert-kangaroo-adapter before passes that replace decoder layers"
            )
        adapter = KangarooAdapter.from_host(
            host_layer,
            gm.get_submodule(norm.target),
            exit_layer=self.exit_layer,
            cache_layer=num_layers,  # one past the host's layers
            attn_kind=kind,
        )
        gm.add_submodule(ADAPTER_MODULE, adapter)

        rope = nodes_by_role(gm, "rotary")[0]
        mask = next(n for n in nodes_by_role(gm, "mask") if n.meta[ATTN_KIND] == kind)
        cache = next(n for n in gm.graph.nodes if n.op == "placeholder" and n.name == "cache")
        emit = NodeChain(gm.graph, source, {EXIT_LAYER: self.exit_layer})

        module = f"{ADAPTER_MODULE}."
        x = emit("adapter_input_norm", "call_module", module + "input_norm", (source,))
        kwargs = {"position_embeddings": rope, "attention_mask": mask}
        kwargs[cache_kwarg(adapter.attention)] = cache  # HF's attention: its name, by version
        attn = emit("adapter_attention", "call_module", module + "attention", (x,), kwargs)
        out = emit("adapter_attention_out", "call_function", operator.getitem, (attn, 0))
        res = emit("adapter_residual", "call_function", operator.add, (source, out))
        normed = emit("adapter_norm", "call_module", module + "output_norm", (res,))
        logits = emit("adapter_logits", "call_module", head.target, (normed,), role="adapter_head")
        attn.meta[WRITES_CACHE] = True
        attn.meta[CACHE_LAYER] = num_layers
        attn.meta[ATTN_KIND] = kind
        source.meta["leapfx.exit_source"] = True
        outputs = dict(output_dict(gm))
        outputs.update(exit_logits=logits, exit_hidden=source)
        set_output_dict(gm, outputs)
        gm.meta[EXIT_LAYER] = self.exit_layer
        gm.meta[EXTRA_CACHE_LAYERS] = gm.meta.get(EXTRA_CACHE_LAYERS, 0) + 1
        return PassResult(gm, modified=True, matches=1)
