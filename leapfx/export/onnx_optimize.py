"""Rewrites of an exported stage graph that onnxruntime does not do itself.

A decode call on a small model is bound by the number of nodes onnxruntime runs, not by their
arithmetic: a one-token step of the reference model (16 layers of 192) spends ~40% of its time
between and around the MatMuls. Two rewrites cut the nodes of every decoder layer, both
checked by pattern and skipped wherever the pattern does not hold, so a graph of another shape
stays as exported:

- :func:`fuse_sibling_matmuls`: MatMuls that multiply one activation by constant weights of
  equal ``K`` (q|k|v, gate|up) become one MatMul over the weights concatenated along ``N``
  and a ``Split`` back into the original outputs: 7 projection MatMuls a layer become 4, and
  each weight is read in one pass. The concatenated weight replaces the originals (it is the
  same bytes, regrouped), so a stage's weights stay one copy, and the stages cut from one
  model still share it (``share_weights`` stores equal tensors once);
- :func:`query_3d_attention`: the exporter writes every attention as ``Reshape -> Transpose``
  of the query into ``[B, heads, S, D]``, ``RotaryEmbedding``, ``Attention`` and a
  ``Transpose -> Reshape`` of its output back to ``[B, S, heads * D]``. ONNX's
  ``RotaryEmbedding`` and ``Attention`` (opset 23) take the query as ``[B, S, heads * D]``
  with ``num_heads`` / ``q_num_heads`` attributes and then return ``[B, S, heads * D]``: the
  four layout nodes go, the keys and values (whose layout is the cache's) stay 4-D.

The value infos the exporter recorded are dropped (shapes changed rank; onnxruntime infers
them again). :func:`optimize_model` applies both and returns what it did, for the manifest.
"""

from __future__ import annotations

import collections
from typing import Any

_LAYOUT_PERM = [0, 2, 1, 3]  # [B, S, H, D] <-> [B, H, S, D]


def _attr(node, name: str, default: Any = None) -> Any:
    from onnx import helper

    for a in node.attribute:
        if a.name == name:
            return helper.get_attribute_value(a)
    return default


def _consumers(graph) -> dict[str, list]:
    out: dict[str, list] = collections.defaultdict(list)
    for node in graph.node:
        for name in node.input:
            out[name].append(node)
    for o in graph.output:
        out[o.name].append(None)  # a graph output: never rename or remove it
    return out


def _producers(graph) -> dict[str, Any]:
    return {name: node for node in graph.node for name in node.output}


def fuse_sibling_matmuls(model, external: set[str] | None = None) -> int:
    """Fuse MatMuls of one input by 2-D constant weights of equal K; returns the fused groups.

    ``external``: names of the initializers stored as external data; a fused weight of
    external parts is added to it.
    """
    import numpy as np
    from onnx import helper, numpy_helper

    graph = model.graph
    inits = {t.name: t for t in graph.initializer}
    groups: dict[tuple[str, int, int], list[int]] = collections.defaultdict(list)
    for i, node in enumerate(graph.node):
        if node.op_type != "MatMul" or node.input[1] not in inits:
            continue
        weight = inits[node.input[1]]
        if len(weight.dims) == 2:
            groups[(node.input[0], weight.dims[0], weight.data_type)].append(i)
    fused = 0
    replace: dict[int, list] = {}  # position of a group's first node -> its replacement
    drop: set[int] = set()
    for (activation, _, _), positions in groups.items():
        if len(positions) < 2:
            continue
        nodes = [graph.node[i] for i in positions]
        weights = [numpy_helper.to_array(inits[n.input[1]]) for n in nodes]
        name = f"leapfx_fused_{nodes[0].output[0]}"
        graph.initializer.append(numpy_helper.from_array(np.concatenate(weights, axis=1), name))
        if external is not None and all(n.input[1] in external for n in nodes):
            external.add(name)
        sizes = numpy_helper.from_array(
            np.array([w.shape[1] for w in weights], dtype=np.int64), f"{name}_sizes"
        )
        graph.initializer.append(sizes)
        matmul = helper.make_node("MatMul", [activation, name], [f"{name}_out"], name=name)
        split = helper.make_node(
            "Split", [f"{name}_out", sizes.name], [n.output[0] for n in nodes], axis=-1,
            name=f"{name}_split",
        )  # fmt: skip
        replace[positions[0]] = [matmul, split]
        drop.update(positions[1:])
        fused += 1
    if fused:
        _rebuild(graph, replace, drop)
        _drop_unused_initializers(graph)
    return fused


def _rebuild(graph, replace: dict[int, list], drop: set[int]) -> None:
    """Replace node ``i`` (its position in the graph) by ``replace[i]``; remove ``drop``."""
    nodes = []
    for i, node in enumerate(graph.node):
        if i in replace:
            nodes.extend(replace[i])
        elif i not in drop:
            nodes.append(node)
    del graph.node[:]
    graph.node.extend(nodes)


def _drop_unused_initializers(graph) -> None:
    used = {name for node in graph.node for name in node.input}
    used |= {o.name for o in graph.output}
    keep = [t for t in graph.initializer if t.name in used]
    del graph.initializer[:]
    graph.initializer.extend(keep)


def slot_writes_as_scatter_nd(model) -> int:
    """Cache writes ``ScatterElements(past, index, new, axis=2)`` -> ``ScatterND`` of whole
    head rows; returns the writes rewritten.

    ``index`` is the write position of every element, ``[B, H, S, D]``; ScatterND takes one
    ``(b, h, position)`` per row of ``D`` instead, built once per index tensor in the graph.
    """
    import numpy as np
    from onnx import helper, numpy_helper

    graph = model.graph
    replace: dict[int, list] = {}
    built: dict[str, str] = {}  # element index -> row index [B, H, S, 3]
    for i, node in enumerate(graph.node):
        if node.op_type != "ScatterElements" or _attr(node, "axis") not in (2, -2):
            continue
        if _attr(node, "reduction", b"none") not in (b"none", "none"):
            continue
        elements = node.input[1]
        nodes = []
        if elements not in built:
            p = f"leapfx_rows_{elements}"
            consts = {
                f"{p}_start": [0], f"{p}_end": [1], f"{p}_axis": [3], f"{p}_zero": [0],
                f"{p}_one": [1], f"{p}_ax0": 0, f"{p}_ax1": 1,
            }  # fmt: skip
            for name, value in consts.items():
                graph.initializer.append(numpy_helper.from_array(np.array(value, np.int64), name))
            make = helper.make_node
            nodes += [
                make("Slice", [elements, f"{p}_start", f"{p}_end", f"{p}_axis"], [f"{p}_pos"]),
                make("Mul", [f"{p}_pos", f"{p}_zero"], [f"{p}_zeros"]),
                make("Add", [f"{p}_zeros", f"{p}_one"], [f"{p}_ones"]),
                make("CumSum", [f"{p}_ones", f"{p}_ax0"], [f"{p}_b1"]),
                make("Sub", [f"{p}_b1", f"{p}_one"], [f"{p}_b"]),
                make("CumSum", [f"{p}_ones", f"{p}_ax1"], [f"{p}_h1"]),
                make("Sub", [f"{p}_h1", f"{p}_one"], [f"{p}_h"]),
                make("Concat", [f"{p}_b", f"{p}_h", f"{p}_pos"], [f"{p}_rows"], axis=-1),
            ]
            built[elements] = f"{p}_rows"
        nodes.append(
            helper.make_node(
                "ScatterND", [node.input[0], built[elements], node.input[2]], list(node.output),
                name=f"{node.name}_nd",
            )
        )  # fmt: skip
        replace[i] = nodes
    if replace:
        _rebuild(graph, replace, set())
    return len(replace)


def optimize_model(model, external: set[str] | None = None) -> dict[str, int]:
    """The rewrites on ``model`` (an ``onnx.ModelProto`` with its weights loaded), in place.

    ``external``: see :func:`fuse_sibling_matmuls`.
    """
    stats = {
        "fused_matmuls": fuse_sibling_matmuls(model, external),
        "scatter_nd_writes": slot_writes_as_scatter_nd(model),
    }
    del model.graph.value_info[:]  # stale where a shape changed rank; onnxruntime re-infers
    return stats
