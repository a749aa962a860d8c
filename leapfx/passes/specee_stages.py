"""specee_stages(): cut a graph with exit predictors into the per-layer stages SpecEE runs.

SpecEE's depth is decided token by token on the host, so its decode step is a chain of short
stages rather than one draft/verify pair (signatures; ``rope`` is the rotary (cos, sin) pair the
draft stage computed for the same positions, so no layer recomputes it)::

``full``     (input_ids, position_ids, masks, cache) -> {logits}
    every layer: prefill ("prefill runs all layers, no exit", the authors' code).
``draft``    (input_ids, position_ids, masks, cache) -> {hidden, logits, candidates, rope}
    the embedding, layers < E and the draft head: h_{E-1}, the draft head's logits and S, its
    top-k ids (the speculative tokens of every later exit check). With an EAGLE head the draft
    stage is layers < E alone ({hidden, rope}); S comes from the head's own stage
    ``eagle_head`` (token and h of the previous position), and ``target`` (the host plus the
    head's KV on true features, returning h) replaces ``full`` for the prefill.
``layer_i``  (hidden, rope, mask, position_ids, cache) -> {hidden}     for i = E..L-1
    one decoder layer; ``mask`` is this layer's own (the KV validity mask of exited tokens).
``check_l``  (hidden, candidates, p_prev) -> {p, prob}                 for l = E-1..L-2
    the exit-check node of layer l: p_l and the MLP's exit probability.
``probs_l``  (hidden, candidates) -> {p}
    p_l alone, for the layer below an active one (D_l needs p_{l-1}).
``rope``     (hidden, position_ids) -> {rope}
    the rotary pair for a batch of positions (kv_fill="next", verification).
``head``     (hidden) -> {logits}
    the final norm and LM head on any layer's hidden state (the global check, the last layer).

The exit checks are tiny; their cost is what the two-level schedule exists to limit, so the
schedule adds their time up (``stage_seconds["predictor"]``).
"""

from __future__ import annotations

import operator

from torch import fx

from ..modules.hf import cache_kwarg, rename_cache_kwarg
from .capture import LAYER, ROLE, nodes_by_role, output_dict
from .eagle_head import eagle_stages
from .partition import (
    INPUT_ROLES,
    Stages,
    _ancestors,
    _copy,
    _finish,
    _placeholders,
    full_stage,
    layer_parts,
)
from .predictor import FIRST_PREDICTED


def specee_stages(gm: fx.GraphModule) -> Stages:
    """Cut ``gm`` (a draft head + InsertExitPredictors) into full, draft, layer_i and head."""
    e = gm.meta[FIRST_PREDICTED] + 1
    outputs = output_dict(gm)
    eagle = "eagle_logits" in outputs
    nodes = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output")]
    inputs = {n.name: n for n in gm.graph.nodes if n.op == "placeholder"}
    parts = layer_parts(gm)
    layer_out = {n.meta[LAYER]: n for n in nodes_by_role(gm, "layer")}
    lower_set = {n for n in nodes if n.meta.get(ROLE) in INPUT_ROLES}
    lower_set = lower_set.union(*(parts[i] for i in range(e)))
    lower = [n for n in nodes if n in lower_set]
    cands = next(n for n in nodes if n.meta.get(ROLE) == "speculative_tokens")
    rope = next(n for n in nodes if n.meta.get(ROLE) == "rotary")
    last_lower = layer_out[e - 1]
    draft = fx.Graph()
    env = {inputs[k]: v for k, v in _placeholders(draft, list(inputs)).items()}
    if eagle:
        # The EAGLE head drafts from the previous position: its own stage (``eagle_head``),
        # and the prefill is its ``target`` stage (which also returns h of the last position).
        _copy(draft, lower, env)
        draft.output({"hidden": env[last_lower], "rope": env[rope]})
        cut = eagle_stages(gm).modules
        modules = {"target": cut["target"], "eagle_head": cut["head"]}
    else:
        head_part = {cands} | _ancestors(cands)
        exit_nodes = [n for n in nodes if n in head_part and n not in lower_set]
        _copy(draft, lower + exit_nodes, env)
        draft.output(
            {
                "hidden": env[last_lower],
                "logits": env[outputs["exit_logits"]],
                "candidates": env[cands],
                "rope": env[rope],
            }
        )
        modules = {"full": full_stage(gm)}
    modules["draft"] = _finish(gm, draft, "draft")

    masks = [n for n in nodes if n.meta.get(ROLE) == "mask"]
    for node in nodes:
        if node.meta.get(ROLE) != "layer" or node.meta[LAYER] < e:
            continue
        graph = fx.Graph()
        ph = _placeholders(graph, ["hidden", "rope", "mask", "position_ids", "cache"])
        i = node.meta[LAYER]
        if node.op != "call_module":  # an MoE layer, captured as its parts: copy them
            below = layer_out[i - 1]
            env = {below: ph["hidden"], rope: ph["rope"], inputs["cache"]: ph["cache"],
                   inputs["position_ids"]: ph["position_ids"],
                   **{m: ph["mask"] for m in masks}}  # fmt: skip
            _copy(graph, [n for n in nodes if n in parts[i]], env)
            graph.output({"hidden": env[node]})
            modules[f"layer_{i}"] = _finish(gm, graph, f"layer_{i}")
            continue
        name = cache_kwarg(gm.get_submodule(node.target))  # the layer's own or HF's (by version)
        kwargs = rename_cache_kwarg(node.kwargs, name)
        kwargs.update(attention_mask=ph["mask"], position_embeddings=ph["rope"])
        kwargs["position_ids"] = ph["position_ids"]
        kwargs[name] = ph["cache"]
        out = graph.call_module(node.target, (ph["hidden"],), kwargs)
        out.meta.update(node.meta)
        out.name = node.name
        graph.output({"hidden": out})
        modules[f"layer_{node.meta[LAYER]}"] = _finish(gm, graph, f"layer_{node.meta[LAYER]}")

    for node in nodes:
        if node.meta.get(ROLE) != "exit_check":
            continue
        i = node.meta[LAYER]
        for name, with_mlp in ((f"check_{i}", True), (f"probs_{i}", False)):
            graph = fx.Graph()
            names = ["hidden", "candidates", "p_prev"] if with_mlp else ["hidden", "candidates"]
            ph = _placeholders(graph, names)
            args = (ph["hidden"], ph["candidates"], ph.get("p_prev"))
            check = graph.call_module(node.target, args, {"with_mlp": with_mlp})
            check.name = node.name
            p = graph.call_function(operator.getitem, (check, 1))
            p.name = "p"
            result = {"p": p}
            if with_mlp:
                prob = graph.call_function(operator.getitem, (check, 0))
                prob.name = "prob"
                result["prob"] = prob
            graph.output(result)
            modules[name] = _finish(gm, graph, name)

    graph = fx.Graph()
    ph = _placeholders(graph, ["hidden", "position_ids"])
    rotary = graph.call_module(rope.target, (ph["hidden"], ph["position_ids"]))
    rotary.name = "rope"
    graph.output({"rope": rotary})
    modules["rope"] = _finish(gm, graph, "rope")

    graph = fx.Graph()
    ph = _placeholders(graph, ["hidden"])
    tail = [n for n in nodes if n.meta.get(ROLE) in ("norm", "head")]
    last_layer = tail[0].args[0]
    env = {last_layer: ph["hidden"]}
    _copy(graph, tail, env)
    graph.output({"logits": env[outputs["logits"]]})
    modules["head"] = _finish(gm, graph, "head")
    return Stages(modules=modules, exit_layer=e)
