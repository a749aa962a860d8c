"""kernel_gate: recognise M2R2's fast-stream stages that one ``leapfx_cpu`` call computes.

``exit_stages`` cuts a gate stage ``gate_j`` out of the rewritten graph: the rotary, the
interval's accelerated layers (one row, reading the slow cache), the final norm + LM head on the
gate's state and the ARLA router over the interval's states; ``fast_stream_stages`` cuts
``m2r2``'s draft stage the same way from the token's embedding. :func:`kernel_gate` recognises
such a stage and returns the module computing the same outputs in one call
(``leapfx.modules.m2r2_kernels``: ``KernelGate`` {logits, score}, ``KernelDraft`` {logits,
hidden}), or None where the op does not cover the model (q/k norms, ``clip_qkv``, partial or
dynamic rotary, sliding windows, ``fast_keys``, a norm that is not an RMSNorm, non-float32
weights); ``kernel_stages`` then keeps the torch stage.
"""

from __future__ import annotations

import torch
from torch import fx, nn

from ..kernels import cpu_m2r2
from ..modules.draft_vocab import SubsetLMHead
from ..modules.kernel_layers import rms_params
from ..modules.m2r2 import ARLARouter
from ..modules.m2r2_kernels import KernelDraft, KernelGate, fused_op_layers, rope_table
from .capture import ROLE


def kernel_gate(stage: fx.GraphModule, fallback: nn.Module) -> KernelGate | KernelDraft | None:
    """A KernelGate for an exit gate stage, a KernelDraft for M2R2's draft stage; None when
    ``stage`` is neither or the op does not cover it. ``fallback`` runs where the op cannot
    (gradients, a one-off dtype)."""
    parts = _stage_parts(stage)
    if parts is None:
        return None

    if not cpu_m2r2.available():
        return None
    first, parts = parts
    if first is None:
        return KernelGate(*parts, fallback=fallback)
    return KernelDraft(first, *parts, fallback=fallback)


def _stage_parts(stage: fx.GraphModule):
    """``(None, (rotary, fast layers, router, final norm, head))`` for a stage that is exactly
    ``exit_stages``' gate (a chain of fast layers from ``hidden``, the router over the chain,
    the head on its end), ``(embedding, (rotary, layers, None, norm, head))`` for exactly
    ``fast_stream_stages``' draft (the chain from the token's embedding); else None."""
    nodes = list(stage.graph.nodes)
    by_role: dict[str, list[fx.Node]] = {}
    for n in nodes:
        if n.op == "call_module":
            by_role.setdefault(n.meta.get(ROLE), []).append(n)
    draft = "embed" in by_role
    single = ("rotary", "gate_norm", "gate_head", "embed" if draft else "router")
    if set(by_role) != {"accelerator", *single}:
        return None
    if any(len(by_role[r]) != 1 for r in single):
        return None
    placeholders = {n.name: n for n in nodes if n.op == "placeholder"}
    start = by_role["embed"][0] if draft else placeholders.get("hidden")
    if draft and by_role["embed"][0].args[0] is not placeholders.get("input_ids"):
        return None
    fast = by_role["accelerator"]
    chain = [start, *fast]
    if any(f.args[0] is not prev for prev, f in zip(chain, fast, strict=False)):
        return None
    scratch = placeholders.get("scratch")
    if any(f.kwargs != ({"scratch": scratch} if draft else {}) for f in fast):
        return None
    (norm,), (head,) = by_role["gate_norm"], by_role["gate_head"]
    if norm.args[0] is not fast[-1] or head.args[0] is not norm:
        return None
    outputs = next(n for n in nodes if n.op == "output").args[0]
    router = None if draft else by_role["router"][0]
    if draft and outputs != {"logits": head, "hidden": fast[-1]}:
        return None
    if not draft and (router.args[0] != chain or outputs != {"logits": head, "score": router}):
        return None
    get = stage.get_submodule
    layers = [get(f.target) for f in fast]
    parts = (get(by_role["rotary"][0].target), layers,
             None if router is None else get(router.target), get(norm.target),
             get(head.target))  # fmt: skip
    if not _covered(*parts):
        return None
    return (get(by_role["embed"][0].target) if draft else None), parts


def _covered(rotary, layers, router, norm, head) -> bool:
    """Whether the op computes this stage exactly as the torch stage does (``router`` None: a
    draft stage)."""
    if router is not None and type(router) is not ARLARouter:
        return False
    if not fused_op_layers(layers, ("q_heads", "kv_heads", "head_dim", "scaling")):
        return False
    for m in layers:
        if m._qk_norm or m._clip is not None or m.window is not None or m.fast_keys is not None:
            return False
    first = layers[0]
    linears = () if router is None else (router.q, router.k, router.v, router.out)
    if not all(type(x) is nn.Linear and x.weight.dtype == torch.float32 for x in linears):
        return False
    # the head: the LM head, or a draft's SubsetLMHead (draft_vocab) whose rows the op reads
    subset = type(head) is SubsetLMHead and head.rows.dtype == torch.float32
    if not (subset or (type(head) is nn.Linear and head.weight.dtype == torch.float32)):
        return False
    return rms_params(norm) is not None and rope_table(rotary, first.head_dim) is not None
