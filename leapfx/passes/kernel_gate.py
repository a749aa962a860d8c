"""KernelGate: an ARLA exit gate stage of ``m2r2_exit`` as one ``leapfx_cpu::m2r2_gate`` call.

``exit_stages`` cuts a gate stage ``gate_j`` out of the rewritten graph: the rotary, the
interval's accelerated layers (one row, reading the slow cache), the final norm + LM head on the
gate's state and the ARLA router over the interval's states. Each piece is a few small torch
ops; together ~90 dispatches a gate, which on a CPU cost about as much as the slow layers an
exit skips (``leapfx.kernels.cpu_m2r2``). :func:`kernel_gate` recognises that stage and returns
a module computing the same outputs ({logits, score}) in one call, or None where the op does
not cover the model (q/k norms, ``clip_qkv``, partial or dynamic rotary, sliding windows,
``fast_keys``, a norm that is not an RMSNorm, non-float32 weights); ``kernel_stages`` then keeps
the torch stage. The merged weights are taken when it is built: build it again after training
(as ``KernelAcceleratedLayer``).
"""

from __future__ import annotations

import torch
from torch import fx, nn

from .accelerator import AcceleratedLayer, ARLARouter, rms_params
from .capture import ROLE

_DYNAMIC_ROPE = ("dynamic", "longrope")  # inv_freq changes with the sequence: not a table


def kernel_gate(stage: fx.GraphModule, fallback: nn.Module) -> KernelGate | None:
    """A KernelGate for the gate stage ``stage``, None when ``stage`` is not a gate stage or the
    op does not cover it; ``fallback`` runs where the op cannot (gradients, a one-off dtype)."""
    parts = _gate_parts(stage)
    if parts is None:
        return None
    from ..kernels import cpu_m2r2

    if not cpu_m2r2.available():
        return None
    return KernelGate(*parts, fallback=fallback)


def _gate_parts(stage: fx.GraphModule):
    """(rotary, fast layers, router, final norm, head) of a gate stage whose graph is exactly
    ``exit_stages``' gate (a chain of fast layers from ``hidden``), else None."""
    nodes = list(stage.graph.nodes)
    by_role: dict[str, list[fx.Node]] = {}
    for n in nodes:
        if n.op == "call_module":
            by_role.setdefault(n.meta.get(ROLE), []).append(n)
    if set(by_role) != {"rotary", "accelerator", "gate_norm", "gate_head", "router"}:
        return None
    if any(len(by_role[r]) != 1 for r in ("rotary", "gate_norm", "gate_head", "router")):
        return None
    hidden = next((n for n in nodes if n.op == "placeholder" and n.name == "hidden"), None)
    fast = by_role["accelerator"]
    chain = [hidden, *fast]
    if any(f.args[0] is not prev for prev, f in zip(chain, fast, strict=False)):
        return None
    (norm,), (head,), (router,) = by_role["gate_norm"], by_role["gate_head"], by_role["router"]
    if norm.args[0] is not fast[-1] or head.args[0] is not norm or router.args[0] != chain:
        return None
    outputs = next(n for n in nodes if n.op == "output").args[0]
    if outputs != {"logits": head, "score": router}:
        return None
    get = stage.get_submodule
    layers = [get(f.target) for f in fast]
    parts = (get(by_role["rotary"][0].target), layers, get(router.target), get(norm.target),
             get(head.target))  # fmt: skip
    return parts if _covered(*parts) else None


def _covered(rotary, layers, router, norm, head) -> bool:
    """Whether the op computes this gate exactly as the torch stage does."""
    if not all(type(m) is AcceleratedLayer for m in layers) or type(router) is not ARLARouter:
        return False
    first = layers[0]
    same = ("q_heads", "kv_heads", "head_dim", "scaling")
    for m in layers:
        plain = not m._qk_norm and m._clip is None and m.window is None and m.fast_keys is None
        if not plain or any(getattr(m, a) != getattr(first, a) for a in same):
            return False
        if m.w_o.dtype != torch.float32 or m.w_o.device.type != "cpu":
            return False
        host = m.host
        if rms_params(host.input_layernorm) is None:
            return False
        if rms_params(host.post_attention_layernorm) is None:
            return False
    linears = (router.q, router.k, router.v, router.out, head)
    if not all(type(x) is nn.Linear and x.weight.dtype == torch.float32 for x in linears):
        return False
    return rms_params(norm) is not None and _rope_table(rotary, first.head_dim) is not None


def _rope_table(rotary: nn.Module, head_dim: int) -> tuple[torch.Tensor, float] | None:
    """(inv_freq, attention_scaling) where ``rotary(x, t)`` is HF's default form
    ``cat(t * inv_freq, t * inv_freq).cos() * scaling`` (and sin) over the whole head, checked
    on probe positions; None otherwise (partial or dynamic rotary)."""
    inv = getattr(rotary, "inv_freq", None)
    scale = getattr(rotary, "attention_scaling", None)
    if getattr(rotary, "rope_type", "default") in _DYNAMIC_ROPE:
        return None
    if not isinstance(inv, torch.Tensor) or inv.dtype != torch.float32 or inv.dim() != 1:
        return None
    if not isinstance(scale, (int, float)) or 2 * inv.numel() != head_dim:
        return None
    positions = torch.tensor([[0, 1, 7, 1000]])
    with torch.no_grad():
        cos, sin = rotary(torch.zeros(1, dtype=torch.float32), positions)
    freqs = positions[..., None].float() * inv
    emb = torch.cat((freqs, freqs), dim=-1)
    want = (emb.cos() * scale, emb.sin() * scale)
    pairs = zip((cos, sin), want, strict=True)
    ok = all(torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in pairs)
    return (inv.detach().contiguous(), float(scale)) if ok else None


def _bias(b: torch.Tensor | None, rows: int) -> torch.Tensor:
    return torch.zeros(rows) if b is None else b


class KernelGate(nn.Module):
    """The gate stage ``{logits, score} = gate(hidden, position_ids, cache)`` in one op call.

    Same numbers as the torch stage up to summation order (a test holds them to 1e-5; an exit
    decision may flip only for a score within that of the threshold)."""

    def __init__(self, rotary, layers, router, norm, head, *, fallback: nn.Module) -> None:
        from ..kernels.cpu_m2r2 import pack_gate

        super().__init__()
        self.fallback = fallback
        self.slots = [m.cache_slot for m in layers]
        first = layers[0]
        inv_freq, rope_scale = _rope_table(rotary, first.head_dim)
        packed, eps, offsets = [], [], []
        hidden = head.weight.shape[1]
        for m in layers:
            w_qkv, b_qkv, w_o, b_o = m._merged()
            ln_in = rms_params(m.host.input_layernorm)
            ln_post = rms_params(m.host.post_attention_layernorm)
            packed.append([w_qkv, _bias(b_qkv, w_qkv.shape[0]), w_o, _bias(b_o, hidden),
                           m.down, m.up, ln_in[0], ln_post[0]])  # fmt: skip
            eps += [ln_in[1], ln_post[1]]
            offsets += [ln_in[2], ln_post[2]]
        final = rms_params(norm)
        eps.append(final[1])
        offsets.append(final[2])
        latent = router.q.weight.shape[0]
        parts = [final[0]]
        for lin in (router.q, router.k, router.v, router.out):
            parts += [lin.weight, _bias(lin.bias, lin.weight.shape[0])]
        self.weights = pack_gate(packed, parts, (head.weight, head.bias), inv_freq)
        self.dims = [len(layers), hidden, first.head_dim, len(first.q_heads),
                     len(first.kv_heads), first.down.shape[0], latent, head.weight.shape[0],
                     *first.kv_heads, *(int(x) for x in first.q_to_kv)]  # fmt: skip
        self.params = [rope_scale, float(first.scaling), *eps, *offsets]

    def forward(self, hidden, position_ids, cache):
        keys = getattr(cache, "keys", None)
        if (
            hidden.dtype != torch.float32
            or hidden.numel() != hidden.shape[-1]
            or (torch.is_grad_enabled() and hidden.requires_grad)
            or not isinstance(keys, list)
            or keys[self.slots[0]].shape[0] != 1  # one sequence: the op reads batch row 0
        ):
            return self.fallback(hidden=hidden, position_ids=position_ids, cache=cache)
        kv = [t for s in self.slots for t in (keys[s], cache.values[s])]
        lengths = [cache.lengths[s] - 1 for s in self.slots]  # slow keys < t (the row's own: t)
        score, logits = torch.ops.leapfx_cpu.m2r2_gate.default(
            hidden.contiguous(), position_ids.contiguous(), self.weights, self.dims,
            self.params, kv, lengths,
        )  # fmt: skip
        return {"logits": logits, "score": score}
