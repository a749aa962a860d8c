"""fast_stream_stages(): cut a graph with an accelerated stream into M2R2's decoding stages.

Stages (GraphModules sharing the model's modules by reference):

``full``   (input_ids, position_ids, masks, cache) -> {logits}
    every slow layer, nothing of the fast stream (prefill, and the verify pass of M2R2's
    self-speculation: one slow pass over [last token, drafts]).
``draft``  (input_ids, position_ids, cache, scratch) -> {logits, hidden}
    the fast stream alone (sec. 2.3.2): embedding -> the accelerated layers of the first
    interval -> final norm -> LM head, on one token at a time. It reads the slow keys of the
    verified positions from ``cache`` and the round's earlier drafts' fast keys from
    ``scratch`` (a ``FastScratch``, which it extends); it writes nothing into ``cache``, and no
    slow layer runs. ``hidden`` is the fast state at the gate.

Example::

    >>> stages = fast_stream_stages(InsertAccelerator(gates=(4,)).run(capture(m)).graph_module)
    >>> sorted(stages.modules)
    ['draft', 'full']
"""

from __future__ import annotations

from torch import fx

from .accelerator import GATE, GATES
from .capture import ROLE, output_dict
from .partition import Stages, _finish, _placeholders, full_stage


def fast_stream_stages(gm: fx.GraphModule) -> Stages:
    """``full`` and ``draft`` stages; the draft is the fast stream up to the first gate."""
    gates = gm.meta.get(GATES)
    if not gates:
        raise ValueError("graph has no accelerated stream; run InsertAccelerator first")
    gate = gates[0]  # the only interval that starts from the embedding (no slow layer)
    outputs = output_dict(gm)
    logits, hidden = outputs[f"gate_logits_{gate}"], outputs[f"gate_hidden_{gate}"]
    inputs = {n.name: n for n in gm.graph.nodes if n.op == "placeholder"}
    graph = fx.Graph()
    ph = _placeholders(graph, ["input_ids", "position_ids", "cache", "scratch"])
    env = {inputs[k]: ph[k] for k in ("input_ids", "position_ids", "cache")}
    keep = {"embed", "rotary"}
    for node in gm.graph.nodes:
        role = node.meta.get(ROLE)
        fast = role == "accelerator" and node.meta[GATE] == gate
        tail = role in ("gate_norm", "gate_head") and node.meta[GATE] == gate
        if role in keep or fast or tail:
            env[node] = graph.node_copy(node, lambda n: env[n])
            if fast:
                env[node].kwargs = {**env[node].kwargs, "scratch": ph["scratch"]}
    graph.output({"logits": env[logits], "hidden": env[hidden]})
    return Stages(modules={"full": full_stage(gm), "draft": _finish(gm, graph, "draft")})
