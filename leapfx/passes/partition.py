"""partition(): cut a rewritten decoder graph into the stages a schedule runs.

Stages are GraphModules with named inputs that share the model's modules by reference:

``full``   (input_ids, position_ids, masks, cache) -> {logits}
    every layer; used for prefill and for the autoregressive schedule.
``draft``  (input_ids, position_ids, masks, cache) -> {logits, hidden}
    layers < E and the exit head; ``hidden`` is the exit hidden state (the exit-query cache).
``verify`` (input_ids, position_ids, masks, exit_hidden, remainder_position_ids,
            remainder_masks, cache) -> {logits}
    the verify remainder. ``exit_hidden`` [B, c, H] holds exit hidden states the draft already
    computed (LayerSkip's exit-query cache); ``input_ids`` [B, m] are tokens the draft has not
    run (the last draft token), which go through layers < E here. Their exit hidden states are
    appended to ``exit_hidden`` and layers >= E, the norm and the head run on all c + m
    positions (``remainder_position_ids``). So verification never recomputes a lower layer.

The draft head is whatever computes the graph's ``exit_logits`` from the lower layers: an exit
head (norm + LM head) or the Kangaroo adapter (norms + attention + LM head). Nodes marked
``leapfx.writes_cache`` (the adapter's attention) fill a KV-cache layer as a side effect, so every
stage that runs the lower layers keeps them even where their output is unused: ``full`` and the
lower part of ``verify`` write the adapter's KV for the positions they run.

Example::

    >>> stages = partition(InsertExitHead(layer=2).run(capture(hf_model)).graph_module)
    >>> sorted(stages.modules)
    ['draft', 'full', 'verify']
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import fx

from .capture import LAYER, ROLE, SIDE_EFFECT, WRITES_CACHE, nodes_by_role, output_dict
from .exit_head import exit_layer_of

# Nodes shared by every layer; a node of decoder layer i (the layer itself, or one of an MoE
# layer's parts: attention, router, experts ...) carries leapfx.layer = i.
INPUT_ROLES = {"embed", "rotary", "mask"}  # what every layer reads besides its input


@dataclass
class Stages:
    """Named stage GraphModules cut from one rewritten graph."""

    modules: dict[str, fx.GraphModule]
    exit_layer: int | None = None

    def __getitem__(self, name: str) -> fx.GraphModule:
        return self.modules[name]

    def __contains__(self, name: str) -> bool:
        return name in self.modules

    def code(self) -> str:
        """The generated Python of every stage, for golden tests and debugging."""
        parts = []
        for name, gm in self.modules.items():
            parts.append(f"# stage: {name}\n{gm.code.strip()}\n")
        return "\n".join(parts)


def layer_parts(gm: fx.GraphModule) -> dict[int, set[fx.Node]]:
    """Decoder layer i -> its nodes: the ``layer`` node itself for a dense layer; for an MoE
    layer (captured as its parts) every node it is computed from that neither a lower layer nor
    the inputs, embedding, rotary table or masks are."""
    below = {n for n in gm.graph.nodes if n.op == "placeholder" or n.meta.get(ROLE) in INPUT_ROLES}
    parts = {}
    for node in nodes_by_role(gm, "layer"):
        mine = ({node} | _ancestors(node)) - below
        parts[node.meta[LAYER]] = mine
        below |= mine
    return parts


def _placeholders(graph: fx.Graph, names: list[str]) -> dict[str, fx.Node]:
    out = {}
    for name in names:
        node = graph.placeholder(name)
        node.meta[ROLE] = "input"
        out[name] = node
    return out


def _copy(graph: fx.Graph, nodes: list[fx.Node], env: dict[fx.Node, fx.Node]) -> None:
    for node in nodes:
        env[node] = graph.node_copy(node, lambda n: env[n])


def _has_side_effect(node: fx.Node) -> bool:
    marked = node.meta.get(WRITES_CACHE, False) or node.meta.get(SIDE_EFFECT, False)
    return marked or node.is_impure()


def _ancestors(node: fx.Node) -> set[fx.Node]:
    seen: set[fx.Node] = set()
    stack = [node]
    while stack:
        for parent in stack.pop().all_input_nodes:
            if parent not in seen:
                seen.add(parent)
                stack.append(parent)
    return seen


def _finish(root: fx.GraphModule, graph: fx.Graph, name: str) -> fx.GraphModule:
    gm = fx.GraphModule(root, graph, class_name=f"{name.capitalize()}Stage")
    gm.graph.eliminate_dead_code(is_impure_node=_has_side_effect)
    gm.graph.lint()
    gm.recompile()
    gm.meta["leapfx.stage"] = name
    return gm


def full_stage(gm: fx.GraphModule) -> fx.GraphModule:
    """The whole model with only the final logits as output."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    body = [n for n in gm.graph.nodes if n.op != "output"]
    _copy(graph, body, env)
    graph.output({"logits": env[output_dict(gm)["logits"]]})
    return _finish(gm, graph, "full")


def partition(gm: fx.GraphModule) -> Stages:
    """Cut ``gm`` (which must have an exit head) into full, draft and verify stages."""
    e = exit_layer_of(gm)
    outputs = output_dict(gm)
    nodes = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output")]
    inputs = {n.name: n for n in gm.graph.nodes if n.op == "placeholder"}

    def is_lower(n: fx.Node) -> bool:
        return n.meta.get(ROLE) in INPUT_ROLES or n.meta.get(LAYER, e) < e

    lower = [n for n in nodes if is_lower(n)]
    # The draft head: what computes exit_logits beyond the lower layers, in graph order.
    head_part = {outputs["exit_logits"]} | _ancestors(outputs["exit_logits"])
    exit_nodes = [n for n in nodes if n in head_part and not is_lower(n)]
    # Cache writers of the draft head and what they read: they run wherever the lower layers run.
    writers = [n for n in exit_nodes if n.meta.get(WRITES_CACHE)]
    writer_part = set(writers).union(*(_ancestors(n) for n in writers))
    lower_writers = [n for n in exit_nodes if n in writer_part]
    upper_layers = [n for n in nodes if n.meta.get(LAYER, -1) >= e]
    tail = [n for n in nodes if n.meta.get(ROLE) in ("norm", "head")]
    rope = next(n for n in nodes if n.meta.get(ROLE) == "rotary")
    masks = [n for n in nodes if n.meta.get(ROLE) == "mask"]

    # draft: layers < E and the exit head.
    draft = fx.Graph()
    env = {inputs[k]: v for k, v in _placeholders(draft, list(inputs)).items()}
    _copy(draft, lower + exit_nodes, env)
    draft.output({"logits": env[outputs["exit_logits"]], "hidden": env[outputs["exit_hidden"]]})

    # verify: lower layers for the tokens the draft has not run, then the remainder.
    verify = fx.Graph()
    names = ["input_ids", "position_ids", "masks", "exit_hidden", "remainder_position_ids"]
    ph = _placeholders(verify, [*names, "remainder_masks", "cache"])
    env = {inputs[k]: ph[k] for k in ("input_ids", "position_ids", "masks", "cache")}
    _copy(verify, lower + lower_writers, env)
    joined = verify.call_function(torch.cat, ([ph["exit_hidden"], env[outputs["exit_hidden"]]], 1))
    joined.name = "exit_query_cache"
    joined.meta[ROLE] = "exit_query_cache"
    # The remainder sees the joined positions: its own rotary embedding and masks.
    upper_env = {inputs["position_ids"]: ph["remainder_position_ids"], inputs["cache"]: ph["cache"]}
    upper_env[inputs["masks"]] = ph["remainder_masks"]
    upper_env[outputs["exit_hidden"]] = joined
    upper_env[rope.args[0]] = joined  # rotary reads only dtype/device from its first argument
    _copy(verify, [rope, *masks], upper_env)
    _copy(verify, upper_layers + tail, upper_env)
    verify.output({"logits": upper_env[outputs["logits"]]})

    return Stages(
        modules={
            "full": full_stage(gm),
            "draft": _finish(gm, draft, "draft"),
            "verify": _finish(gm, verify, "verify"),
        },
        exit_layer=e,
    )


def early_exit_stages(gm: fx.GraphModule) -> Stages:
    """Stages for lossy early-exit inference: only the draft stage is needed."""
    stages = partition(gm)
    return Stages(modules={"draft": stages["draft"]}, exit_layer=stages.exit_layer)
