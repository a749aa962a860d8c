"""``draft_chain``: D greedy draft steps as one ONNX graph, composed from the draft stage.

A fixed-length greedy draft (layerskip with ``confidence_threshold=0``) calls the ``draft``
stage D times a round, each call fed the argmax of the one before: D session calls, each with
its Python/binding glue and onnxruntime's per-run overhead. The chain runs the D steps in one:

    step i:  input_ids_i    = input_ids  (i = 0)  |  tokens[i - 1]  (i > 0)
             position_ids_i = position_ids + i
             logits_i, hidden_i, present_i = draft(input_ids_i, position_ids_i, past)
             tokens[i]      = ArgMax(logits_i[:, -1])
    outputs: tokens [B, D] int64, hidden = concat(hidden_i) [B, D, H],
             present_{D-1} as ``present.{l}.*``, present_i (i < D-1) as ``present.{l}.*.step{i}``

It is built from the *optimized* ``draft.onnx`` by copying its nodes D times with their
intermediate tensors renamed per step (``chain.{i}/<name>``), not by tracing a PyTorch loop:
the rewrites of ``onnx_optimize`` match a layer whose cache write reads a graph input and
feeds only its own attention, and key each ``GroupQueryAttention``'s ``seqlens_k`` by the
position graph input; in a traced loop step i's present feeds step i+1's write and the
positions of step i > 0 are ``position_ids + i``, so no layer after the first step would be
rewritten (see :func:`~leapfx.export.onnx_optimize.group_query_attention`). Composed, every
step is the draft graph as optimized, node for node: its outputs are the draft stage's, bit
for bit. The weights are the draft's initializers, referenced by every step under their own
names: one copy in the graph and in ``weights.bin``.

The cache: every step reads the graph's ``past_key_values.{l}.*`` inputs and writes outputs of
its own, and a runtime binds the past input and all D presents of a cache layer to its one
buffer (IO binding, as for every stage). Each step then writes its position in place and the
next step reads it there: step i+1 runs on the argmax of step i's logits, so it starts after
every write of step i. (Threading step i's presents into step i+1 as its pasts instead makes
them onnxruntime's own tensors, which its CPU ``GroupQueryAttention`` fills by copying the
past: on the reference model that chain was no faster than the 4 calls it replaces, in place
it is ~11% faster.) The price: without that binding (a plain ``session.run``) step i+1 does
not see step i's keys; the manifest says so.

Example::

    >>> chain = unroll_draft(onnx.load("draft.onnx", load_external_data=False), 4)
    >>> onnx.save(chain, "draft_chain.onnx")   # beside draft.onnx: its weights stay shared
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..lower.stage_signature import step_present

PAST = "past_key_values."
PRESENT = "present."
# The draft stage's tensor inputs and the outputs a chain reads.
_TENSOR_INPUTS = ("input_ids", "position_ids")
_DRAFT_OUTPUTS = ("logits", "hidden")
CHAIN_OUTPUTS = ("tokens", "hidden")


def _present_of(past: str) -> str:
    return PRESENT + past.removeprefix(PAST)


def _check_draft(graph) -> None:
    """ValueError unless ``graph`` has the draft stage's signature (asserted by the exporter)."""
    inputs = [i.name for i in graph.input]
    outputs = [o.name for o in graph.output]
    pasts = [n for n in inputs if n.startswith(PAST)]
    problems = []
    if inputs[: len(_TENSOR_INPUTS)] != list(_TENSOR_INPUTS) or len(inputs) != 2 + len(pasts):
        problems.append(f"inputs {inputs} are not input_ids, position_ids and the cache")
    if outputs[:2] != list(_DRAFT_OUTPUTS) or outputs[2:] != [_present_of(p) for p in pasts]:
        problems.append(f"outputs {outputs} are not logits, hidden and the presents")
    if any(a.type in (a.GRAPH, a.GRAPHS) for node in graph.node for a in node.attribute):
        problems.append("it has nodes with subgraphs")
    if problems:
        raise ValueError(f"draft_chain: the draft stage cannot be unrolled: {'; '.join(problems)}")


def chain_outputs(presents: list[str], length: int) -> list[str]:
    """The chain's outputs, in order, for the draft's ``presents`` (see :func:`unroll_draft`)."""
    steps = [step_present(p, i) for i in range(length - 1) for p in presents]
    return [*CHAIN_OUTPUTS, *presents, *steps]


def unroll_draft(draft, length: int) -> Any:
    """The ``draft_chain`` model: ``length`` greedy steps of the ``draft`` ONNX model (see the
    module docstring). ``draft`` is loaded without its external data (the chain refers to the
    same weights, in the same files); it is not modified."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    if not isinstance(length, int) or length < 2:
        raise ValueError(f"length: {length!r} is invalid; allowed: an integer >= 2")
    graph = draft.graph
    _check_draft(graph)
    shared = {t.name for t in graph.initializer} | {""}  # weights and absent optional inputs
    pasts = [i.name for i in graph.input if i.name.startswith(PAST)]
    outputs = {o.name: o for o in graph.output}
    nodes = []
    initializers = list(graph.initializer)
    feeds = {name: name for name in (*_TENSOR_INPUTS, *pasts)}  # every step reads the pasts
    tokens, hidden = [], []
    step_outputs: list[tuple[str, str]] = []  # (a step's present output, the present it is)
    for i in range(length):
        last = i == length - 1

        def rename(name: str, i=i, feeds=feeds, last=last) -> str:
            if name in shared:
                return name
            if name in feeds:
                return feeds[name]
            if name in outputs and name.startswith(PRESENT):
                # the last step's presents are the graph's; the others' outputs of their own
                return name if last else step_present(name, i)
            return f"chain.{i}/{name}"

        for node in graph.node:
            copy = onnx.NodeProto()
            copy.CopyFrom(node)
            copy.name = f"chain.{i}/{node.name}" if node.name else ""  # names are optional
            copy.input[:] = [rename(n) for n in node.input]
            copy.output[:] = [rename(n) for n in node.output]
            nodes.append(copy)
        token = f"chain.{i}/token"
        # logits: [B, 1, V] -> [B, 1]; ArgMax picks the first of equal maxima, as torch.argmax
        nodes.append(
            helper.make_node(
                "ArgMax",
                [rename("logits")],
                [token],
                name=f"chain.{i}/argmax",
                axis=-1,
                keepdims=0,
            )  # fmt: skip
        )
        tokens.append(token)
        hidden.append(rename("hidden"))
        if last:
            break
        offset = f"leapfx_chain_offset_{i + 1}"
        initializers.append(numpy_helper.from_array(_int64(i + 1), offset))
        positions = f"chain.{i + 1}/position_ids"
        nodes.append(
            helper.make_node(
                "Add", ["position_ids", offset], [positions], name=f"chain.{i + 1}/positions"
            )
        )
        feeds = {"input_ids": token, "position_ids": positions, **{p: p for p in pasts}}
        step_outputs += [(step_present(_present_of(p), i), _present_of(p)) for p in pasts]
    nodes.append(helper.make_node("Concat", tokens, ["tokens"], name="chain/tokens", axis=1))
    nodes.append(helper.make_node("Concat", hidden, ["hidden"], name="chain/hidden", axis=1))

    inputs = []
    for value in graph.input:
        copy = onnx.ValueInfoProto()
        copy.CopyFrom(value)
        if value.name in _TENSOR_INPUTS:  # one token in: [batch, 1]
            dim = copy.type.tensor_type.shape.dim[1]
            dim.Clear()
            dim.dim_value = 1
        inputs.append(copy)
    batch = graph.input[0].type.tensor_type.shape.dim[0]
    batch = batch.dim_param or batch.dim_value
    h = outputs["hidden"].type.tensor_type
    size = h.shape.dim[2].dim_value or h.shape.dim[2].dim_param
    chain_outputs = [
        helper.make_tensor_value_info("tokens", TensorProto.INT64, [batch, length]),
        helper.make_tensor_value_info("hidden", h.elem_type, [batch, length, size]),
        *(outputs[_present_of(p)] for p in pasts),
    ]
    for name, present in step_outputs:
        value = onnx.ValueInfoProto()
        value.CopyFrom(outputs[present])
        value.name = name
        chain_outputs.append(value)
    chain_graph = helper.make_graph(
        nodes, "draft_chain", inputs, chain_outputs, initializer=initializers
    )
    model = helper.make_model(
        chain_graph, opset_imports=list(draft.opset_import), ir_version=draft.ir_version
    )
    model.functions.extend(draft.functions)
    model.producer_name, model.producer_version = draft.producer_name, draft.producer_version
    return model


def _int64(value: int):
    return np.array(value, dtype=np.int64)
