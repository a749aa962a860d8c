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
    slow layer runs. ``hidden`` is the fast state at the gate. (Exported to ONNX, the scratch
    and the verified length become tensors in and out: ``leapfx.export.fast_draft``.)

Example::

    >>> stages = fast_stream_stages(InsertAccelerator(gates=(4,)).run(capture(m)).graph_module)
    >>> sorted(stages.modules)
    ['draft', 'full']
"""

from __future__ import annotations

from torch import fx

from .accelerator import GATE, GATES
from .capture import ROLE, output_dict
from .partition import Stages, _copy, _finish, _placeholders, full_stage, layer_parts


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


def exit_stages(gm: fx.GraphModule) -> Stages:
    """M2R2's early-exit stages (ARLA, sec. 2.3.1), for gates E_1..E_J (E_0 = 0, E_{J+1} = N):

    ``full``     (input_ids, position_ids, masks, cache) -> {logits}: the prefill.
    ``slow_0``   (input_ids, position_ids, masks, cache) -> {hidden, reset}: embedding (reset),
                 layers < E_1.
    ``slow_j``   (hidden, position_ids, masks, cache) -> {hidden}: layers E_j..E_{j+1}-1 on the
                 rows given (the current token, and the previous token's rows while its
                 skipped layers are filled), writing their keys into ``cache``.
    ``gate_j``   (hidden, position_ids, cache) -> {logits, score}, j = 1..J: the fast stream
                 of interval j-1 from the reset state ``hidden`` = h^{E_{j-1}} (one row), the
                 final norm and LM head on its gate state, and the gate's ARLA score.
    ``tail``     (hidden, position_ids, cache) -> {logits}: the final norm and LM head on h^N
                 (position_ids and cache unused: the signature every row stage shares).
    """
    gates = gm.meta.get(GATES)
    if not gates:
        raise ValueError("graph has no accelerated stream; run InsertAccelerator first")
    outputs = output_dict(gm)
    nodes = list(gm.graph.nodes)
    inputs = {n.name: n for n in nodes if n.op == "placeholder"}
    embed = next(n for n in nodes if n.meta.get(ROLE) == "embed")
    rope = next(n for n in nodes if n.meta.get(ROLE) == "rotary")
    masks = [n for n in nodes if n.meta.get(ROLE) == "mask"]
    layers = [n for n in nodes if n.meta.get(ROLE) == "layer"]
    parts = layer_parts(gm)  # an MoE layer's parts, a dense layer's node
    num_layers = len(layers)
    edges = (0, *gates, num_layers)
    modules = {"full": full_stage(gm)}
    for j, (a, b) in enumerate(zip(edges, edges[1:], strict=False)):
        graph = fx.Graph()
        first = "input_ids" if a == 0 else "hidden"
        ph = _placeholders(graph, [first, "position_ids", "masks", "cache"])
        env = {inputs[k]: ph[k] for k in ("position_ids", "masks", "cache")}
        if a == 0:
            env[inputs["input_ids"]] = ph["input_ids"]
            _copy(graph, [embed], env)
        else:
            env[layers[a - 1]] = ph["hidden"]
        env[rope.args[0]] = env[embed if a == 0 else layers[a - 1]]  # dtype/device only
        slow = set().union(*(parts[i] for i in range(a, b)))
        _copy(graph, [rope, *masks, *(n for n in nodes if n in slow)], env)
        out = {"hidden": env[layers[b - 1]]}
        if a == 0:
            out["reset"] = env[embed]  # the fast stream of the first interval starts here
        graph.output(out)
        modules[f"slow_{j}"] = _finish(gm, graph, f"slow_{j}")
    for j, (a, b) in enumerate(zip(edges, edges[1:-1], strict=False), start=1):
        graph = fx.Graph()
        ph = _placeholders(graph, ["hidden", "position_ids", "cache"])
        reset = embed if a == 0 else layers[a - 1]
        env = {reset: ph["hidden"], inputs["position_ids"]: ph["position_ids"]}
        env[inputs["cache"]] = ph["cache"]
        env[rope.args[0]] = ph["hidden"]
        _copy(graph, [rope, *(n for n in nodes if n.meta.get(GATE) == b)], env)
        score = outputs.get(f"gate_score_{b}")
        if score is None:
            raise ValueError(f"gates: gate {b} has no ARLA router; insert it with routers=True")
        graph.output({"logits": env[outputs[f"gate_logits_{b}"]], "score": env[score]})
        modules[f"gate_{j}"] = _finish(gm, graph, f"gate_{j}")
    graph = fx.Graph()
    ph = _placeholders(graph, ["hidden", "position_ids", "cache"])  # the rows' call signature
    env = {layers[-1]: ph["hidden"]}
    _copy(graph, [n for n in nodes if n.meta.get(ROLE) in ("norm", "head")], env)
    graph.output({"logits": env[outputs["logits"]]})
    modules["tail"] = _finish(gm, graph, "tail")
    return Stages(modules=modules)
