"""Capture: a HuggingFace decoder-only causal LM as a layer-level ``torch.fx.GraphModule``.

The graph is built by hand rather than traced: one ``call_module`` node per decoder-level piece
(token embedding, rotary embedding, each decoder layer, final norm, LM head), each annotated in
``node.meta`` with ``leapfx.role`` and, for layers, ``leapfx.layer``. The nodes call the HF
model's own submodules, so the graph computes exactly what the HF model computes and shares its
weights by reference (``GraphModule`` copies module references, not tensors).

Mixture-of-Experts layers (mixtral, qwen2_moe, qwen3_moe, olmoe) are captured one level deeper,
so that passes see the routing: the layer becomes its attention half (input norm, attention,
residual), the post-attention norm, a ``router`` node (the block's ``gate``: logits, top-k
weights, top-k expert ids), an ``experts`` node (the fused ``<X>Experts`` module, called as
``experts(hidden [T, H], top_k_index [T, k], top_k_weights [T, k])``), qwen2_moe's gated shared
expert, and the residual add, which carries ``leapfx.role = "layer"`` like a dense layer's node.
Every node of layer i carries ``leapfx.layer = i``; each calls the HF module (or the same tensor
op) that the HF layer calls, in the same order, so the result is bitwise the HF layer's. A pass
can retarget the ``experts`` node (the expert-offload runtime does) or read the router's ids.
Dense layers of MoE models (``mlp_only_layers``) stay one node.

Graph inputs (placeholders)::

    input_ids     [B, S]    token ids
    position_ids  [B, S]    absolute positions (rotary)
    masks         dict      attention-mask kind -> mask or None (see runtime.masks)
    cache         KVCache   the shared static KV cache (or None: no cache)

and the output is ``{"logits": [B, S, V]}``. Passes add outputs (an exit head adds
``exit_logits`` and ``exit_hidden``).

Example::

    >>> gm = capture(hf_model)
    >>> [n.meta.get("leapfx.role") for n in gm.graph.nodes][:4]
    ['input', 'input', 'input', 'input']
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
from torch import fx, nn

from ..modules.hf import cache_kwarg

ROLE = "leapfx.role"
LAYER = "leapfx.layer"
ATTN_KIND = "leapfx.attn_kind"
# A node that writes the KV cache as a side effect: stages keep it even when its output is unused.
WRITES_CACHE = "leapfx.writes_cache"
# A node run for its side effect other than the KV cache (an expert prefetch): stages keep it.
SIDE_EFFECT = "leapfx.side_effect"
# GraphModule meta: KV-cache layers the rewrite adds past the host's layers (an adapter attention).
EXTRA_CACHE_LAYERS = "leapfx.extra_cache_layers"

# A node's module path in the HF model (a decoder layer's, for every node of that layer): passes
# that need the HF layer (Kangaroo copies its attention) look it up with layer_module().
MODULE = "leapfx.module"

# model_type -> notes on what differs. The decoder layers of all of these take the same call
# (hidden, attention_mask=, position_embeddings=, position_ids=, <cache>=) and return a
# tensor, the embedding module applies any embedding scale itself (Gemma), and none of them
# soft-caps logits.
SUPPORTED_ARCHITECTURES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM (sliding window honoured)",
    "qwen2": "Qwen2ForCausalLM (per-layer sliding window honoured)",
    "qwen3": "Qwen3ForCausalLM (q/k norms inside the layer)",
    "phi3": "Phi3ForCausalLM (fused qkv / gate_up projections)",
    "gemma": "GemmaForCausalLM (scaled embedding, 1+w norms)",
    "mixtral": "MixtralForCausalLM (MoE; top-k always renormalised; sliding window honoured)",
    "qwen2_moe": "Qwen2MoeForCausalLM (MoE + sigmoid-gated shared expert; norm_topk_prob)",
    "qwen3_moe": "Qwen3MoeForCausalLM (MoE; q/k norms; norm_topk_prob; mlp_only_layers)",
    "olmoe": "OlmoeForCausalLM (MoE; full-width q/k norms, clip_qkv; norm_topk_prob)",
}
# Architectures whose every sliding window applies to all layers (create_sliding_window_causal_mask
# for the whole model) rather than per layer through config.layer_types.
_MODEL_WIDE_WINDOW = ("mistral", "phi3", "mixtral", "qwen3_moe")


@dataclass(frozen=True)
class DecoderPieces:
    """The decoder-level submodules of a HF causal LM, by reference, with their paths.

    "Pieces", not "parts": in leapfx "parts" are the trained parts a recipe inserts and saves
    (``save_parts``, ``apply(..., parts=dir)``); these are the host model's own."""

    embed: nn.Module
    rotary: nn.Module
    layers: list[nn.Module]
    norm: nn.Module
    head: nn.Module
    prefix: str  # path of the inner decoder model, e.g. "model"
    attn_kinds: list[str]  # per layer: "full_attention" or "sliding_attention"
    sliding_window: int | None

    @property
    def num_layers(self) -> int:
        return len(self.layers)


def check_supported(model: nn.Module) -> str:
    """Return the model's ``model_type`` or raise ValueError listing the supported ones."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_ARCHITECTURES:
        supported = ", ".join(sorted(SUPPORTED_ARCHITECTURES))
        name = type(model).__name__
        raise ValueError(
            f"model: architecture {model_type!r} ({name}) is not supported; "
            f"supported model_type values are: {supported}"
        )
    if not hasattr(model, "lm_head") or not hasattr(model, "model"):
        raise ValueError(
            f"model: expected a *ForCausalLM with .model and .lm_head, got {type(model).__name__}"
        )
    return model_type


def decoder_pieces(model: nn.Module) -> DecoderPieces:
    """Find the embedding, rotary embedding, layers, final norm and LM head of ``model``.

    >>> pieces = decoder_pieces(hf_model)
    >>> pieces.num_layers == hf_model.config.num_hidden_layers
    True
    """
    check_supported(model)
    inner = model.model
    config = model.config
    n = config.num_hidden_layers
    layer_types = getattr(config, "layer_types", None) or ["full_attention"] * n
    window = getattr(config, "sliding_window", None)
    if model.config.model_type in _MODEL_WIDE_WINDOW and window:
        # These models apply the window to every layer (create_sliding_window_causal_mask).
        layer_types = ["sliding_attention"] * n
    if not window:  # qwen2_moe stores 0 when use_sliding_window is off
        layer_types = ["full_attention"] * n
        window = None
    return DecoderPieces(
        embed=inner.embed_tokens,
        rotary=inner.rotary_emb,
        layers=list(inner.layers[:n]),
        norm=inner.norm,
        head=model.lm_head,
        prefix="model",
        attn_kinds=list(layer_types[:n]),
        sliding_window=window,
    )


def _annotate(node: fx.Node, role: str, layer: int | None = None, **extra) -> fx.Node:
    node.meta[ROLE] = role
    if layer is not None:
        node.meta[LAYER] = layer
    for key, value in extra.items():
        node.meta[f"leapfx.{key}"] = value
    return node


def capture(model: nn.Module) -> fx.GraphModule:
    """Capture ``model`` (a supported HF ``*ForCausalLM``) as a layer-level GraphModule.

    The model is not modified; the returned GraphModule references its submodules.

    >>> gm = capture(hf_model)
    >>> out = gm(input_ids, position_ids, masks, None)["logits"]   # == hf_model(input_ids).logits
    """
    pieces = decoder_pieces(model)
    graph = fx.Graph()
    input_ids = _annotate(graph.placeholder("input_ids"), "input")
    position_ids = _annotate(graph.placeholder("position_ids"), "input")
    masks = _annotate(graph.placeholder("masks"), "input")
    cache = _annotate(graph.placeholder("cache"), "input")

    hidden = _annotate(graph.call_module("model.embed_tokens", (input_ids,)), "embed")
    hidden.name = "embed"
    rope = _annotate(graph.call_module("model.rotary_emb", (hidden, position_ids)), "rotary")
    rope.name = "rope"
    mask_nodes: dict[str, fx.Node] = {}
    for kind in dict.fromkeys(pieces.attn_kinds):
        mask_nodes[kind] = _annotate(
            graph.call_function(operator.getitem, (masks, kind)), "mask", attn_kind=kind
        )
        mask_nodes[kind].name = f"mask_{kind}"
    for i, kind in enumerate(pieces.attn_kinds):
        path = f"model.layers.{i}"
        context = {
            "attention_mask": mask_nodes[kind],
            "position_embeddings": rope,
            "position_ids": position_ids,
        }
        if is_moe_layer(pieces.layers[i]):
            context[cache_kwarg(pieces.layers[i].self_attn)] = cache
            hidden = _moe_layer(graph, i, pieces.layers[i], path, hidden, context, kind)
            continue
        context[cache_kwarg(pieces.layers[i])] = cache
        hidden = graph.call_module(path, (hidden,), context)
        hidden.name = f"layer_{i}"
        _annotate(hidden, "layer", i, attn_kind=kind, module=path)
    normed = _annotate(graph.call_module("model.norm", (hidden,)), "norm")
    normed.name = "norm"
    logits = _annotate(graph.call_module("lm_head", (normed,)), "head")
    logits.name = "logits"
    graph.output({"logits": logits})
    graph.lint()
    gm = fx.GraphModule(model, graph, class_name="DecoderGraph")
    gm.meta["leapfx.model_type"] = model.config.model_type
    gm.meta["leapfx.num_layers"] = pieces.num_layers
    gm.meta["leapfx.stages"] = ["full"]
    return gm


def is_moe_layer(layer: nn.Module) -> bool:
    """Whether ``layer``'s MLP is a sparse MoE block (a ``gate`` router and fused ``experts``)."""
    mlp = getattr(layer, "mlp", None)
    experts = getattr(mlp, "experts", None)
    return hasattr(mlp, "gate") and hasattr(experts, "gate_up_proj")


def _moe_layer(
    graph: fx.Graph, i: int, layer: nn.Module, path: str, hidden: fx.Node, context: dict, kind: str
) -> fx.Node:
    """Emit MoE decoder layer ``i`` as its nodes (the HF layer's forward, op for op)."""

    def emit(name: str, role: str, op: str, target, args: tuple, kwargs=None) -> fx.Node:
        node = graph.create_node(op, target, args, kwargs or {}, name=f"layer_{i}_{name}")
        return _annotate(node, role, i, attn_kind=kind, module=path)

    residual = hidden
    h = emit("attn_norm", "attn_norm", "call_module", f"{path}.input_layernorm", (hidden,))
    kwargs = {"hidden_states": h, **context}
    attn = emit("attention", "attention", "call_module", f"{path}.self_attn", (), kwargs)
    attn = emit("attn_out", "attn_out", "call_function", operator.getitem, (attn, 0))
    h = emit("attn_residual", "attn_residual", "call_function", operator.add, (residual, attn))
    residual = h
    normed = emit("moe_norm", "moe_norm", "call_module", f"{path}.post_attention_layernorm", (h,))
    # [B, S, H] -> [T, H]: the router and the experts see flat tokens.
    width = layer.self_attn.config.hidden_size
    flat = emit("moe_input", "moe_input", "call_method", "view", (normed, -1, width))
    mlp = f"{path}.mlp"
    route = emit("router", "router", "call_module", f"{mlp}.gate", (flat,))
    weights = emit("top_k_weights", "router_weights", "call_function", operator.getitem,
                   (route, 1))  # fmt: skip
    index = emit("top_k_index", "router_index", "call_function", operator.getitem, (route, 2))
    out = emit("experts", "experts", "call_module", f"{mlp}.experts", (flat, index, weights))
    if hasattr(layer.mlp, "shared_expert"):  # qwen2_moe: sigmoid(gate(x)) * shared_expert(x)
        shared = emit("shared_expert", "shared_expert", "call_module", f"{mlp}.shared_expert",
                      (flat,))  # fmt: skip
        gate = emit("shared_gate", "shared_expert", "call_module", f"{mlp}.shared_expert_gate",
                    (flat,))  # fmt: skip
        gate = emit("shared_sigmoid", "shared_expert", "call_function", torch.sigmoid, (gate,))
        shared = emit("shared_out", "shared_expert", "call_function", operator.mul, (gate, shared))
        out = emit("moe_sum", "shared_expert", "call_function", operator.add, (out, shared))
    out = emit("moe_out", "moe_out", "call_method", "reshape_as", (out, normed))
    out = emit("out", "layer", "call_function", operator.add, (residual, out))
    out.name = f"layer_{i}"
    return out


def layer_module(gm: fx.GraphModule, index: int) -> nn.Module:
    """The HF decoder layer ``index`` (or, for an MoE layer, a container of its submodules).

    Passes that read a layer's own modules (Kangaroo copies its ``self_attn`` and
    ``input_layernorm``) use this rather than a node's target, which passes may retarget and
    which an MoE layer's output node does not have.
    """
    node = layer_node(gm, index)
    assert node is not None and MODULE in node.meta, "capture annotates every decoder layer"
    return gm.get_submodule(node.meta[MODULE])


class NodeChain:
    """Inserts nodes one after another from ``point``, so they keep the order they are made
    in; each is tagged with its role (its name unless given) and ``meta``. Example::

        emit = NodeChain(gm.graph, last)
        joined = emit("eagle_cat", "call_function", torch.cat, ([embed, prev], -1))
    """

    def __init__(self, graph: fx.Graph, point: fx.Node, meta: dict | None = None) -> None:
        self.graph = graph
        self.point = point
        self.meta = meta or {}

    def __call__(self, name: str, op: str, target, args: tuple, kwargs=None, role=None) -> fx.Node:
        with self.graph.inserting_after(self.point):
            node = self.graph.create_node(op, target, args, kwargs or {}, name=name)
        node.meta[ROLE] = role or name
        node.meta.update(self.meta)
        self.point = node
        return node


def nodes_by_role(gm: fx.GraphModule, role: str) -> list[fx.Node]:
    """All nodes of ``gm`` whose ``leapfx.role`` is ``role``, in graph order."""
    return [n for n in gm.graph.nodes if n.meta.get(ROLE) == role]


def layer_node(gm: fx.GraphModule, index: int) -> fx.Node | None:
    """The node of decoder layer ``index``, or None when the graph has none."""
    for node in nodes_by_role(gm, "layer"):
        if node.meta.get(LAYER) == index:
            return node
    return None


def output_dict(gm: fx.GraphModule) -> dict[str, fx.Node]:
    """The graph's output dict (name -> node)."""
    out = next(n for n in gm.graph.nodes if n.op == "output")
    result = out.args[0]
    assert isinstance(result, dict), "leapfx graphs return a dict of named outputs"
    return result


def set_output_dict(gm: fx.GraphModule, outputs: dict[str, fx.Node]) -> None:
    out = next(n for n in gm.graph.nodes if n.op == "output")
    out.args = (dict(outputs),)
