"""InsertEagleHead: EAGLE's draft head (Li et al. 2024) as a graph rewrite, and its stages.

The head drafts at the feature level. At position ``t`` it reads the host's last-layer hidden
state of the previous position ``h_{t-1}`` (the residual stream after the last decoder layer,
BEFORE the final norm; zeros at position 0) and the embedding of the current token ``x_t``::

    g_t    = layer(fc(cat(embed(x_t), h_{t-1})))     # fc: Linear(2D -> D), layer: one decoder
    logits = lm_head(norm(g_t))                       #   layer of the host's own class
                                                      # norm, lm_head: the host's, shared

``g_t`` regresses the host's own ``h_t`` and ``logits`` its distribution of ``x_{t+1}``
(``leapfx.train.eagle``). While drafting a chain the head feeds its own ``g`` back in place of
the host's ``h`` it does not have yet.

EAGLE itself reads the post-norm feature (the LM head's input) and has no norm before its LM
head. Here the head reads and predicts the pre-norm residual stream and shares the host's final
norm: that is the state a decoder layer takes (so the copied layer below starts on the
statistics it was trained on) and the one an early-exit layer hands over (SpecEE feeds the
hidden state of the layer a token exited at).

The head's modules live in an :class:`EagleHead` that the rewritten GraphModule owns
(``gm.eagle_head``); nothing is added to the user's model, and the embedding, final norm and LM
head stay shared by reference. Its attention has its own layer in the shared KV cache (one past
the host's layers and any cache layer an earlier pass added, recorded in
``gm.meta["leapfx.extra_cache_layers"]``), so ``crop`` rolls it back with the rest.

Graph after the pass (nodes inserted after the last layer, roles ``eagle_*``)::

    layer_{L-1} -> eagle_prev_hidden (shift right by one position, zeros first)
    cat(embed, eagle_prev_hidden) -> eagle_fc -> eagle_layer -> eagle_norm (shared)
                                  -> eagle_logits (lm_head, shared)

with outputs ``eagle_logits`` [B, S, V], ``eagle_hidden`` [B, S, D] (the head's g) and
``last_hidden`` [B, S, D] (layer L-1's output). ``eagle_layer`` is marked
``leapfx.writes_cache``: a stage that runs the host also fills the head's cache layer from the
host's true features (the teacher-forced head), so the head has KV for every committed position.

Stages (:func:`eagle_stages`; the ``eagle`` recipe and SpecEE use them)::

    target (input_ids [B, S], position_ids, masks, prev_hidden [B, 1, D], cache)
        -> {logits [B, S, V], hidden [B, S, D]}
       every host layer (host KV for the S positions), the final norm and LM head, and the
       head's fc + layer on the true features (head KV for the same positions); ``prev_hidden``
       is h of the position before the chunk (zeros [B, 1, 1] or None for a chunk at position
       0: zeros),
       ``hidden`` is the pre-norm last-layer state of every position.
    head   (input_ids [B, S], position_ids, masks, hidden [B, S, D], cache)
        -> {logits [B, S, V], hidden [B, S, D]}
       the draft head alone: ``hidden`` is h_{t-1} for each token x_t (or the head's own g while
       chaining), writes the head's cache layer for the S positions, returns the head's logits
       (through the shared norm and LM head) and g.

``leapfx.runtime.eagle.head_step`` / ``target_step`` call them through a ``StageRunner``. A
recipe with other stages (SpecEE) adds ``head_stage(gm)`` to its own under the name ``head``.
The head's cache layer must hold every position before a head call reads it: either its stages
keep the ``eagle_*`` nodes wherever the last layer runs (as ``target`` does), or it calls the
head on the committed positions' true h (a multi-token ``head_step``) before drafting again.

Example::

    >>> gm = InsertEagleHead().run(capture(hf_model)).graph_module
    >>> sorted(gm(input_ids, position_ids, masks, None))
    ['eagle_hidden', 'eagle_logits', 'last_hidden', 'logits']
    >>> stages = eagle_stages(gm)
    >>> out = stages["head"](input_ids=x, position_ids=p, masks=m, hidden=h, cache=cache)
    >>> out["logits"].topk(4).indices        # SpecEE's k = 4 candidate tokens
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import fx

from ..modules.eagle import EagleHead
from ..modules.fused import FusedDecoderLayer, fusable
from ..modules.hf import CACHE_KWARG, cache_kwarg, rename_cache_kwarg
from ..options import is_int
from .base import GraphPass, PassResult, owned
from .capture import (
    ATTN_KIND,
    EXTRA_CACHE_LAYERS,
    ROLE,
    WRITES_CACHE,
    NodeChain,
    layer_module,
    nodes_by_role,
    output_dict,
    set_output_dict,
)
from .partition import Stages, _finish, _placeholders

HEAD_MODULE = "eagle_head"  # attribute of the rewritten GraphModule
EAGLE_LAYER = "leapfx.eagle_layer"  # gm.meta: the head's KV-cache layer
CACHE_LAYER = "leapfx.cache_layer"  # node.meta: the KV-cache layer index an attention writes


def previous_hidden(last_hidden: torch.Tensor, first: torch.Tensor | None = None) -> torch.Tensor:
    """h_{t-1} for every position t of a chunk: ``last_hidden`` [B, S, D] shifted right by one.

    ``first`` [B, 1, D] is h of the position before the chunk; None (a chunk at position 0,
    or training on whole windows) puts zeros there, as the head is trained, and so does a
    zero ``first`` of shape [B, 1, 1] (broadcast: a schedule that does not know D passes it,
    and a compiled stage cannot take None).
    """
    if first is None:
        first = torch.zeros_like(last_hidden[:, :1])
    first = first.expand(-1, -1, last_hidden.shape[-1])
    return torch.cat([first, last_hidden[:, :-1]], dim=1)


def eagle_head_of(gm: fx.GraphModule) -> EagleHead:
    """The EagleHead a graph rewritten by InsertEagleHead owns."""
    return owned(gm, HEAD_MODULE, EagleHead, "EAGLE head", "InsertEagleHead")


@dataclass(frozen=True)
class InsertEagleHead(GraphPass):
    """Insert EAGLE's draft head after the last decoder layer.

    ``init_layer``: the host layer whose copy starts the head's decoder layer (None: the last,
    see ``EagleHead.from_host``).
    """

    name: ClassVar[str] = "insert-eagle-head"
    requires: ClassVar[frozenset[str]] = frozenset({"decoder-graph"})
    provides: ClassVar[frozenset[str]] = frozenset({"eagle-head"})

    init_layer: int | None = None

    def run(self, gm: fx.GraphModule) -> PassResult:
        layers = nodes_by_role(gm, "layer")
        num_layers = len(layers)
        init = num_layers - 1 if self.init_layer is None else self.init_layer
        if not (is_int(init) and 0 <= init < num_layers):
            raise ValueError(
                f"init_layer: {self.init_layer!r} is out of range for a {num_layers}-layer "
                f"model; allowed: 0..{num_layers - 1} or None (the last layer)"
            )
        if nodes_by_role(gm, "eagle_layer"):
            return PassResult(gm, modified=False, matches=0)  # already there
        source_node = next(n for n in layers if n.meta["leapfx.layer"] == init)
        host_layer = layer_module(gm, init)  # an MoE layer's output node has no module
        if not hasattr(host_layer, "self_attn") or not hasattr(host_layer, "input_layernorm"):
            raise ValueError(
                f"layer {init} is a {type(host_layer).__name__}, not a HF decoder layer; run "
                "insert-eagle-head before passes that replace decoder layers"
            )
        kind = source_node.meta[ATTN_KIND]
        cache_layer = num_layers + gm.meta.get(EXTRA_CACHE_LAYERS, 0)
        head = EagleHead.from_host(
            host_layer, init_layer=init, cache_layer=cache_layer, attn_kind=kind
        )
        gm.add_submodule(HEAD_MODULE, head)

        last = layers[-1]
        embed = nodes_by_role(gm, "embed")[0]
        rope = nodes_by_role(gm, "rotary")[0]
        mask = next(n for n in nodes_by_role(gm, "mask") if n.meta[ATTN_KIND] == kind)
        norm = nodes_by_role(gm, "norm")[0]
        lm_head = nodes_by_role(gm, "head")[0]
        placeholders = {n.name: n for n in gm.graph.nodes if n.op == "placeholder"}
        emit = NodeChain(gm.graph, last)

        prev = emit("eagle_prev_hidden", "call_function", previous_hidden, (last,))
        joined = emit("eagle_cat", "call_function", torch.cat, ([embed, prev], -1))
        fused = emit("eagle_fc", "call_module", f"{HEAD_MODULE}.fc", (joined,))
        kwargs = {
            "attention_mask": mask,
            "position_embeddings": rope,
            "position_ids": placeholders["position_ids"],
        }
        kwargs[cache_kwarg(head.layer)] = placeholders["cache"]  # HF's layer: its name, by version
        hidden = emit("eagle_layer", "call_module", f"{HEAD_MODULE}.layer", (fused,), kwargs)
        normed = emit("eagle_norm", "call_module", norm.target, (hidden,))
        logits = emit("eagle_logits", "call_module", lm_head.target, (normed,), role="eagle_head")
        hidden.meta[WRITES_CACHE] = True
        hidden.meta[CACHE_LAYER] = cache_layer
        hidden.meta[ATTN_KIND] = kind
        outputs = dict(output_dict(gm))
        outputs.update(eagle_logits=logits, eagle_hidden=hidden, last_hidden=last)
        set_output_dict(gm, outputs)
        gm.meta[EAGLE_LAYER] = cache_layer
        gm.meta[EXTRA_CACHE_LAYERS] = gm.meta.get(EXTRA_CACHE_LAYERS, 0) + 1
        return PassResult(gm, modified=True, matches=1)


@dataclass(frozen=True)
class FuseEagleHeadLayer(GraphPass):
    """Run the head's decoder layer as a FusedDecoderLayer (``fuse_layers``; same math, same
    weights by reference, no nn.Module dispatch): the head runs once per draft, so its
    dispatch overhead counts as much as one host layer's."""

    name: ClassVar[str] = "fuse-eagle-head-layer"
    requires: ClassVar[frozenset[str]] = frozenset({"eagle-head"})
    provides: ClassVar[frozenset[str]] = frozenset({"eagle-head-fused"})

    def run(self, gm: fx.GraphModule) -> PassResult:
        node = nodes_by_role(gm, "eagle_layer")[0]
        layer = gm.get_submodule(node.target)
        if isinstance(layer, FusedDecoderLayer) or not fusable(layer):
            return PassResult(gm, modified=False, matches=0)
        gm.add_submodule("leapfx_fused.eagle_layer", FusedDecoderLayer(layer))
        node.target = "leapfx_fused.eagle_layer"
        node.kwargs = rename_cache_kwarg(node.kwargs, CACHE_KWARG)
        return PassResult(gm, modified=True, matches=1)


def eagle_layer_of(gm: fx.GraphModule) -> int:
    """The KV-cache layer of the EAGLE head of ``gm``."""
    if EAGLE_LAYER not in gm.meta:
        raise ValueError("graph has no EAGLE head; run InsertEagleHead first")
    return gm.meta[EAGLE_LAYER]


def _copy_with(graph: fx.Graph, nodes: list[fx.Node], env: dict[fx.Node, fx.Node]) -> None:
    for node in nodes:
        if node not in env:  # nodes already in env are replaced by the stage's own
            env[node] = graph.node_copy(node, lambda n: env[n])


def _stage_graph(gm: fx.GraphModule, own: str):
    """A stage's new graph over ``gm``'s shared inputs and its ``own`` one: ``gm``'s outputs by
    name, the graph, its placeholders by name, and ``env`` mapping ``gm``'s shared
    placeholders to the stage's."""
    eagle_layer_of(gm)
    inputs = {n.name: n for n in gm.graph.nodes if n.op == "placeholder"}
    graph = fx.Graph()
    ph = _placeholders(graph, ["input_ids", "position_ids", "masks", own, "cache"])
    env = {inputs[k]: ph[k] for k in ("input_ids", "position_ids", "masks", "cache")}
    return output_dict(gm), graph, ph, env


def target_stage(gm: fx.GraphModule) -> fx.GraphModule:
    """The host and the teacher-forced head: see the module docstring (``target``)."""
    outputs, graph, ph, env = _stage_graph(gm, "prev_hidden")
    prev = nodes_by_role(gm, "eagle_prev_hidden")[0]
    body = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output")]
    _copy_with(graph, body[: body.index(prev)], env)
    shifted = graph.call_function(previous_hidden, (env[prev.args[0]], ph["prev_hidden"]))
    shifted.name = "eagle_prev_hidden"
    shifted.meta.update(prev.meta)
    env[prev] = shifted
    _copy_with(graph, body, env)
    graph.output({"logits": env[outputs["logits"]], "hidden": env[outputs["last_hidden"]]})
    return _finish(gm, graph, "target")


def head_stage(gm: fx.GraphModule) -> fx.GraphModule:
    """The draft head alone: see the module docstring (``head``)."""
    outputs, graph, ph, env = _stage_graph(gm, "hidden")
    env[nodes_by_role(gm, "eagle_prev_hidden")[0]] = ph["hidden"]
    roles = {"embed", "rotary", "mask", "eagle_cat", "eagle_fc", "eagle_layer", "eagle_norm"}
    roles.add("eagle_head")
    nodes = [n for n in gm.graph.nodes if n.meta.get(ROLE) in roles]
    _copy_with(graph, nodes, env)
    out = {"logits": env[outputs["eagle_logits"]], "hidden": env[outputs["eagle_hidden"]]}
    graph.output(out)
    return _finish(gm, graph, "head")


def eagle_stages(gm: fx.GraphModule) -> Stages:
    """Cut a graph with an EAGLE head into the ``target`` and ``head`` stages."""
    return Stages(modules={"target": target_stage(gm), "head": head_stage(gm)})


__all__ = [
    "EagleHead",
    "FuseEagleHeadLayer",
    "InsertEagleHead",
    "eagle_head_of",
    "eagle_layer_of",
    "eagle_stages",
    "head_stage",
    "previous_hidden",
    "target_stage",
]
