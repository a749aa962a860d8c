"""Rewrites of an exported stage graph that onnxruntime does not do itself.

A decode call on a small model is bound by the number of nodes onnxruntime runs, not by their
arithmetic: a one-token step of the reference model (16 layers of 192) spends ~40% of its time
between and around the MatMuls. The rewrites cut the nodes of every decoder layer, each
checked by pattern and skipped wherever the pattern does not hold, so a graph of another shape
stays as exported:

- :func:`fuse_sibling_matmuls`: MatMuls that multiply one activation by constant weights of
  equal ``K`` (q|k|v, gate|up) become one MatMul over the weights concatenated along ``N``
  and a ``Split`` back into the original outputs: 7 projection MatMuls a layer become 4, and
  each weight is read in one pass. The concatenated weight replaces the originals (it is the
  same bytes, regrouped), so a stage's weights stay one copy, and the stages cut from one
  model still share it (``share_weights`` stores equal tensors once);
- :func:`group_query_attention`: each layer's head split (``Reshape`` + ``Transpose`` of q, k
  and v), rotary (``RotaryEmbedding`` over ``Cos``/``Sin`` of the positions), cache writes
  (``ScatterElements``), ``Attention`` under the position mask and head join become one
  ``com.microsoft.GroupQueryAttention`` over the packed q|k|v projection, which writes the
  new keys and values into the cache buffers in place: ~17 nodes a layer become 1, and the
  attention runs on the grouped heads without copies (reference model, one thread: a full step
  1.27 -> 0.99 ms, a draft 0.69 -> 0.54 ms, a verify of 5 rows 1.82 -> 1.24 ms);
- :func:`slot_writes_as_scatter_nd`: the cache writes of layers the previous rewrite does not
  take (a model with a sliding window, a q/k norm, a head size onnxruntime refuses), traced as
  ``ScatterElements`` (one index per element), become ``ScatterND`` of whole head rows.

The value infos the exporter recorded are dropped (shapes changed rank; onnxruntime infers
them again). :func:`optimize_model` applies them and returns what it did, for the manifest.
"""

from __future__ import annotations

import collections
from typing import Any

import numpy as np

from ..lower.onnx_graph import attr, drop_dead_nodes, drop_unused_initializers, reads

_LAYOUT_PERM = [0, 2, 1, 3]  # [B, S, H, D] <-> [B, H, S, D]


def _consumers(graph) -> dict[str, list]:
    out: dict[str, list] = collections.defaultdict(list)
    for node in graph.node:
        for name in reads(node):  # a subgraph's reads of outer values count as its node's
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
        drop_unused_initializers(graph)
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


def _is_slot_write(node) -> bool:
    """A ``ScatterElements`` along the cache's position axis that overwrites (no reduction)."""
    reduction = attr(node, "reduction", b"none")
    return attr(node, "axis") in (2, -2) and reduction in (b"none", "none")


def slot_writes_as_scatter_nd(model) -> int:
    """Cache writes ``ScatterElements(past, index, new, axis=2)`` -> ``ScatterND`` of whole
    head rows; returns the writes rewritten.

    ``index`` is the write position of every element, ``[B, H, S, D]``; ScatterND takes one
    ``(b, h, position)`` per row of ``D`` instead, built once per index tensor in the graph.
    """
    from onnx import helper, numpy_helper

    graph = model.graph
    replace: dict[int, list] = {}
    built: dict[str, str] = {}  # element index -> row index [B, H, S, 3]
    for i, node in enumerate(graph.node):
        if node.op_type != "ScatterElements" or not _is_slot_write(node):
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


_POSITION_INPUTS = ("position_ids", "remainder_position_ids")
_MS_DOMAIN = "com.microsoft"


def _only_consumer(consumers: dict[str, list], name: str, op_type: str):
    """The one node reading ``name`` if it is an ``op_type`` node, else None."""
    users = consumers.get(name, [])
    if len(users) == 1 and users[0] is not None and users[0].op_type == op_type:
        return users[0]
    return None


def _head_layout(producers: dict[str, Any], name: str, consumers: dict[str, list]):
    """``name = Transpose(Reshape(x), perm=[0, 2, 1, 3])`` (the exporter's 3-D -> 4-D head
    split, read by one node): returns ``x``, the ``[B, S, heads * D]`` tensor, else None."""
    t = producers.get(name)
    if t is None or t.op_type != "Transpose" or list(attr(t, "perm", [])) != _LAYOUT_PERM:
        return None
    r = producers.get(t.input[0])
    if r is None or r.op_type != "Reshape" or len(consumers[t.input[0]]) != 1:
        return None
    return r.input[0]


def _rotary_table(producers, inits, cos_name: str, sin_name: str):
    """``cos = Cos(t)``, ``sin = Sin(t)``, ``t = Mul(positions, inv_freq)`` with a constant
    ``inv_freq``: returns (``inv_freq`` as an array, the Mul's position operand), else None."""
    from onnx import numpy_helper

    cos, sin = producers.get(cos_name), producers.get(sin_name)
    if cos is None or sin is None or (cos.op_type, sin.op_type) != ("Cos", "Sin"):
        return None
    if cos.input[0] != sin.input[0]:
        return None
    mul = producers.get(cos.input[0])  # shared by the Cos/Sin pairs of q and k
    if mul is None or mul.op_type != "Mul":
        return None
    for i in (0, 1):
        if mul.input[1 - i] in inits:
            freq = numpy_helper.to_array(inits[mul.input[1 - i]]).reshape(-1)
            return freq, mul.input[i]
    return None


def _packed(producers, consumers, inits, qkv: tuple[str, str, str], heads: dict, size: int):
    """The one ``[B, S, (heads + 2 * kv_heads) * D]`` tensor that ``q, k, v`` are split from
    (``fuse_sibling_matmuls``'s q|k|v MatMul), read by nothing else; else None.

    GroupQueryAttention takes it packed as it is: the ``Split`` (a copy of every row) goes.
    """
    from onnx import numpy_helper

    split = producers.get(qkv[0])
    if split is None or split.op_type != "Split" or tuple(split.output) != qkv:
        return None
    if attr(split, "axis", 0) not in (-1, 2) or len(split.input) != 2:
        return None
    if split.input[1] not in inits:
        return None
    sizes = numpy_helper.to_array(inits[split.input[1]]).tolist()
    q, kv = heads["num_heads"] * size, heads["kv_num_heads"] * size
    if sizes != [q, kv, kv]:
        return None
    if any(len(consumers[name]) != 1 for name in qkv):  # each: its head split, which goes
        return None
    return split.input[0]


def _reshapes_to(node, producers, inits, dims: tuple[int, int]) -> bool:
    """``node`` reshapes to ``Concat(b, [dims[0]], s, [dims[1]])``: ``[B, heads, S, D]``."""
    from onnx import numpy_helper

    concat = producers.get(node.input[1])
    if concat is None or concat.op_type != "Concat" or len(concat.input) != 4:
        return False
    for name, want in zip(concat.input[1::2], dims, strict=True):
        if name not in inits or numpy_helper.to_array(inits[name]).tolist() != [want]:
            return False
    return True


def _graph_inputs_under(producers, name: str, inputs: set[str]) -> set[str]:
    """The graph inputs among ``inputs`` that ``name`` is computed from."""
    seen, stack, found = set(), [name], set()
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if n in inputs:
            found.add(n)
        node = producers.get(n)
        if node is not None:
            stack.extend(i for i in node.input if i)
    return found


def group_query_attention(model, external: set[str] | None = None, *, max_positions: int) -> int:
    """Each layer's rotary + cache write + attention -> one ``com.microsoft.GroupQueryAttention``;
    returns the attentions rewritten.

    The exported layer splits q, k and v into heads (``Reshape`` + ``Transpose`` each), rotates q
    and k (``RotaryEmbedding`` over ``Cos``/``Sin`` of ``positions * inv_freq``), writes k and v
    into the cache buffers (``ScatterND``), attends under the mask built from the positions and
    joins the heads again: ~14 nodes a layer, and at 1-5 query rows onnxruntime's time goes to
    running nodes, not to arithmetic. onnxruntime's CPU (and CUDA) ``GroupQueryAttention`` does
    all of it in one kernel on the ``[B, S, heads * D]`` projections, with the cache in the same
    ``[B, H_kv, max_cache_len, D]`` layout and the same in-place convention: when ``past`` and
    ``present`` are one buffer it writes only the new rows. It reads the positions as
    ``seqlens_k`` (the last position of each row) and ``position_ids`` (for the rotary tables,
    ``max_positions`` rows of ``cos``/``sin`` stored once), and masks causally: query ``s`` of a
    call of ``S`` rows is position ``seqlens_k - S + 1 + s`` and sees the slots up to it, which is
    the exported mask when the positions are consecutive and the keys are written at them, as
    the schedules do. Without a shared buffer (a plain ``session.run``), ``present`` holds the
    past rows up to the last position and the new ones; slots beyond are unspecified (no query
    reads them before they are written).

    Only layers that match the pattern exactly are rewritten: full (not sliding-window)
    attention, full-width non-interleaved rotary over a constant ``inv_freq`` (no rope
    scaling factor after ``Cos``), no soft cap, no per-head q/k norm, a head size that is a
    multiple of 16 (onnxruntime's kernel requires it), keys and values written only into their
    slot. The tables (``2 * max_positions * D / 2`` numbers) are stored once beside the weights.
    """
    from onnx import TensorProto, helper, numpy_helper

    graph = model.graph
    inits = {t.name: t for t in graph.initializer}
    producers, consumers = _producers(graph), _consumers(graph)
    inputs = {i.name: i for i in graph.input}
    positions_in = set(_POSITION_INPUTS) & set(inputs)
    replace: dict[int, list] = {}
    index = {id(node): i for i, node in enumerate(graph.node)}
    drop: set[int] = set()
    tables: dict[str, tuple[str, str]] = {}  # dtype -> (cos, sin) initializers
    lengths: dict[str, tuple[str, ...]] = {}  # position input -> (seqlens_k, total, rows)
    head: list = []
    for node in graph.node:
        if node.op_type != "Attention" or node.domain not in ("", "ai.onnx"):
            continue
        if len(node.input) > 4 or len(node.output) != 1 or attr(node, "is_causal", 0):
            continue
        if attr(node, "softcap", 0.0) or attr(node, "qk_matmul_output_mode", 0):
            continue
        q_rot, present_k, present_v = node.input[:3]
        rq, wk, wv = producers.get(q_rot), producers.get(present_k), producers.get(present_v)
        if rq is None or wk is None or wv is None or rq.op_type != "RotaryEmbedding":
            continue
        writes = ("ScatterND", "ScatterElements")
        if wk.op_type not in writes or wv.op_type != wk.op_type or wk.input[1] != wv.input[1]:
            continue
        if wk.op_type == "ScatterElements" and not _is_slot_write(wk):
            continue
        rk = producers.get(wk.input[2])
        if rk is None or rk.op_type != "RotaryEmbedding":
            continue
        if any(attr(r, "interleaved", 0) or attr(r, "rotary_embedding_dim", 0) for r in (rq, rk)):
            continue
        if len(rq.input) != 3 or len(rk.input) != 3:
            continue
        past_k, past_v = wk.input[0], wv.input[0]
        if past_k not in inputs or past_v not in inputs:
            continue
        # the cache writes feed only this attention (and the graph outputs)
        readers = consumers[present_k] + consumers[present_v]
        if any(c is not None and c is not node for c in readers):
            continue
        q3 = _head_layout(producers, rq.input[0], consumers)
        k3 = _head_layout(producers, rk.input[0], consumers)
        v3 = _head_layout(producers, wv.input[2], consumers)
        rotary = _rotary_table(producers, inits, rq.input[1], rq.input[2])
        if None in (q3, k3, v3, rotary):
            continue
        freq, angle_positions = rotary
        same = _rotary_table(producers, inits, rk.input[1], rk.input[2])
        if same is None or same[1] != angle_positions or not np.array_equal(same[0], freq):
            continue
        dims = (attr(rq, "num_heads"), 2 * len(freq))  # the query's heads and head size
        if dims[0] is None or attr(rk, "num_heads") is None or dims[1] % 16:
            continue  # (onnxruntime's kernel takes head sizes in multiples of 16)
        out = node
        between = _only_consumer(consumers, node.output[0], "Reshape")
        if between is not None and _reshapes_to(between, producers, inits, dims):
            out = between  # the exporter's no-op Reshape to [B, heads, S, D] (dynamic S)
        out_t = _only_consumer(consumers, out.output[0], "Transpose")
        if out_t is None or list(attr(out_t, "perm", [])) != _LAYOUT_PERM:
            continue
        out_r = _only_consumer(consumers, out_t.output[0], "Reshape")
        if out_r is None:
            continue
        source = _graph_inputs_under(producers, angle_positions, positions_in)
        if len(source) != 1 or _graph_inputs_under(producers, wk.input[1], positions_in) != source:
            continue
        (positions,) = source
        dtype = inputs[past_k].type.tensor_type.elem_type
        np_dtype = helper.tensor_dtype_to_np_dtype(dtype)
        key = str(np_dtype)
        if key not in tables:
            angles = np.arange(max_positions, dtype=np.float32)[:, None] * freq[None, :]
            names = (f"leapfx_rotary_cos_{key}", f"leapfx_rotary_sin_{key}")
            for name, fn in zip(names, (np.cos, np.sin), strict=True):
                table = fn(angles.astype(np.float64)).astype(np.float32).astype(np_dtype)
                graph.initializer.append(numpy_helper.from_array(table, name))
                if external is not None:
                    external.add(name)
            tables[key] = names
        if positions not in lengths:
            p = f"leapfx_{positions}"
            graph.initializer.extend([
                numpy_helper.from_array(np.array(-1, np.int64), f"{p}_last_index"),
                numpy_helper.from_array(np.array(0, np.int64), f"{p}_first_index"),
                numpy_helper.from_array(np.array(1, np.int64), f"{p}_one"),
            ])  # fmt: skip
            make = helper.make_node
            head += [
                make("Gather", [positions, f"{p}_last_index"], [f"{p}_last"], axis=1),  # [B]
                make("Cast", [f"{p}_last"], [f"{p}_seqlens_k"], to=TensorProto.INT32),
                make("ReduceMax", [f"{p}_last"], [f"{p}_max"], keepdims=0),
                make("Add", [f"{p}_max", f"{p}_one"], [f"{p}_total64"]),
                make("Cast", [f"{p}_total64"], [f"{p}_total"], to=TensorProto.INT32),
                # rows per query: onnxruntime's CPU kernel takes several rows over a past at
                # batch > 1 only with them spelled out
                make("Gather", [positions, f"{p}_first_index"], [f"{p}_first"], axis=1),
                make("Sub", [f"{p}_last", f"{p}_first"], [f"{p}_span"]),
                make("Add", [f"{p}_span", f"{p}_one"], [f"{p}_rows64"]),
                make("Cast", [f"{p}_rows64"], [f"{p}_rows"], to=TensorProto.INT32),
            ]
            lengths[positions] = (f"{p}_seqlens_k", f"{p}_total", f"{p}_rows")
        seqlens, total, rows = lengths[positions]
        cos, sin = tables[key]
        attrs = {
            "num_heads": attr(rq, "num_heads"),
            "kv_num_heads": attr(rk, "num_heads"),
            "do_rotary": 1,
            "rotary_interleaved": 0,
        }
        if attr(node, "scale") is not None:
            attrs["scale"] = attr(node, "scale")
        qkv = [_packed(producers, consumers, inits, (q3, k3, v3), attrs, dims[1]), "", ""]
        if qkv[0] is None:
            qkv = [q3, k3, v3]
        gqa = helper.make_node(
            "GroupQueryAttention",
            [*qkv, past_k, past_v, seqlens, total, cos, sin, positions]
            + [""] * 6 + [rows],  # (attention_bias ... k_norm_weight), query_seqlens
            [out_r.output[0], present_k, present_v],
            name=f"leapfx_gqa_{node.name}", domain=_MS_DOMAIN, **attrs,
        )  # fmt: skip
        replace[index[id(node)]] = [gqa]
        drop.update(index[id(n)] for n in (wk, wv, out, out_t, out_r) if n is not node)
    if not replace:
        return 0
    _rebuild(graph, replace, drop)
    nodes = head + list(graph.node)
    del graph.node[:]
    graph.node.extend(nodes)
    drop_dead_nodes(graph)
    drop_unused_initializers(graph)
    if not any(o.domain == _MS_DOMAIN for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid(_MS_DOMAIN, 1))
    return len(replace)


def optimize_model(
    model, external: set[str] | None = None, *, max_positions: int | None = None
) -> dict[str, int]:
    """The rewrites on ``model`` (an ``onnx.ModelProto`` with its weights loaded), in place.

    ``external``: see :func:`fuse_sibling_matmuls`. ``max_positions``: the positions the
    rotary tables of :func:`group_query_attention` cover (None: that rewrite is skipped).
    """
    stats = {"fused_matmuls": fuse_sibling_matmuls(model, external)}
    if max_positions is not None:  # first: it takes the cache writes it replaces as traced
        stats["group_query_attention"] = group_query_attention(
            model, external, max_positions=max_positions
        )
    stats["scatter_nd_writes"] = slot_writes_as_scatter_nd(model)  # the writes left
    del model.graph.value_info[:]  # stale where a shape changed rank; onnxruntime re-infers
    return stats
