"""ONNX graph edits the onnxruntime loader makes, and the node helpers the export's rewrites share.

:func:`remainder_graph` cuts verify's upper part out of an exported verify graph when an
``OnnxModel`` opens the export (``SplitVerify``); the export's rewrites
(``leapfx.export.onnx_optimize``, a floor above) use the same helpers. onnx is imported where
it is used: it comes with the ``onnx`` extra.
"""

from __future__ import annotations

import copy
from typing import Any


def attr(node, name: str, default: Any = None) -> Any:
    """The value of ``node``'s attribute ``name``, or ``default`` where it has none."""
    from onnx import helper

    for a in node.attribute:
        if a.name == name:
            return helper.get_attribute_value(a)
    return default


def reads(node) -> list[str]:
    """The names ``node`` reads: its inputs and, for a node with subgraphs (an ``If``: M2R2's
    draft chooses its top-k keys in one), every name a subgraph's nodes read, the outer
    values it uses by name included (a superset: a name produced inside counts too)."""
    names = [i for i in node.input if i]
    for a in node.attribute:
        for g in [a.g] if a.HasField("g") else list(a.graphs):
            names += [name for inner in g.node for name in reads(inner)]
            names += [o.name for o in g.output]
    return names


def drop_dead_nodes(graph) -> None:
    """Remove the nodes none of whose outputs is read (by a kept node or a graph output)."""
    used = {o.name for o in graph.output}
    keep = []
    for node in reversed(graph.node):
        if any(o in used for o in node.output):
            keep.append(node)
            used.update(reads(node))
    del graph.node[:]
    graph.node.extend(reversed(keep))


def drop_unused_initializers(graph) -> None:
    """Remove the initializers no node (or subgraph of one) and no graph output reads."""
    used = {name for node in graph.node for name in reads(node)}
    used |= {o.name for o in graph.output}
    keep = [t for t in graph.initializer if t.name in used]
    del graph.initializer[:]
    graph.initializer.extend(keep)


def remainder_graph(model, lower_layers: list[int]):
    """A verify stage's graph without its lower part, or None where its shape differs.

    Verify runs the round's last new tokens through the layers below the exit
    (``position_ids``, cache layers ``lower_layers``), joins their exit states to the cached
    ones (``Concat(exit_hidden, h)``) and runs the rows through the layers from the exit up.
    The returned copy starts at that join: its ``exit_hidden`` input holds all the rows (the
    cached states and the new tokens' ones), and the lower layers, their cache layers and
    ``input_ids`` / ``position_ids`` are gone. Run after the draft stage on the new tokens (the
    same lower layers, which return the exit states as ``hidden``), it computes what verify
    computes; a runtime with one copy of packed weights per session then keeps the lower
    layers' weights in the draft session only (see ``leapfx.lower.ort_stages.SplitVerify``).
    """
    graph = model.graph
    joins = [n for n in graph.node if n.op_type == "Concat" and n.input[:1] == ["exit_hidden"]]
    if len(joins) != 1 or len(joins[0].input) != 2 or attr(joins[0], "axis") not in (1, -2):
        return None
    out = copy.deepcopy(model)
    graph = out.graph
    joined = joins[0].output[0]
    for node in graph.node:
        for i, name in enumerate(node.input):
            if name == joined:
                node.input[i] = "exit_hidden"
    lower = {f"present.{i}.{kv}" for i in lower_layers for kv in ("key", "value")}
    outputs = [o for o in graph.output if o.name not in lower]
    del graph.output[:]
    graph.output.extend(outputs)
    drop_dead_nodes(graph)
    drop_unused_initializers(graph)
    used = {name for node in graph.node for name in node.input}
    if used & {"input_ids", "position_ids"} or any(
        f"past_key_values.{i}.{kv}" in used for i in lower_layers for kv in ("key", "value")
    ):
        return None  # the upper layers read the lower part some other way: not ours to cut
    inputs = [i for i in graph.input if i.name in used]
    del graph.input[:]
    graph.input.extend(inputs)
    del graph.value_info[:]
    return out
